"""Who may call what: the internal services take calls from their orchestrator only.

* ``make_server(auth_token=...)``: every internal RPC (target Info, Prefill, Verify, Release; draft
  Info, Propose, Release) without the token, with a wrong one or a malformed header is answered
  UNAUTHENTICATED (reason ``UNAUTHENTICATED``) and runs nothing (no session opened); the health
  service stays open; reflection is off unless asked, and behind the token when both are on.
* The token's sources (``--auth-token-file``: owner-only file; ``$DFLASH_AUTH_TOKEN``) and their
  refusals, the flags of the three services, ``main()`` of the target and draft services wiring
  them, and the token never in a log line or an error message.
* End to end: ``python -m orchestrator --auth-token-file`` generates speculatively against a
  token-protected target and draft (in this process); without the token it stops at start.
  Orchestrator -> target over mutual TLS with the token.
* ``dflash-grpc serve`` / ``demo`` make a private token file by default (argv of
  ``dflash_services``, file mode, removed at exit) or take the user's.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import stat
import subprocess
import sys

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dflash_grpc import serving
from dflash_grpc.transport import GRPC_OPTIONS, TlsConfig, reason_of
from dflash_grpc.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from runtime.errors import Reason
from tests.conftest import draft_in_process, module_service, target_in_process
from tests.test_tls import _files, certs  # noqa: F401 - certs: the fixture (a CA, server and client certificates)

UNAUTH = grpc.StatusCode.UNAUTHENTICATED
TOKEN = secrets.token_urlsafe(32)
CONTEXT = 64


def _md(token: str | None = TOKEN, scheme: str = "Bearer") -> list[tuple[str, str]]:
    return [] if token is None else [("authorization", f"{scheme} {token}".strip())]


#: metadata that must all be refused: none, a wrong token, the token one character off, another
#: scheme, the bare scheme, the token without a scheme, the token twice
BAD_METADATA = [
    [], _md("x" * 43), _md(TOKEN[:-1] + ("A" if TOKEN[-1] != "A" else "B")), _md(TOKEN, "Basic"), _md(""),
    [("authorization", TOKEN)], _md() + _md(),
]


@pytest.fixture(autouse=True)
def _client_settings_restored():
    """Each test leaves the process-wide channel metadata and TLS as it found them."""
    md, tls = serving.client_metadata(), serving.client_tls()
    yield
    serving.set_client_metadata(md)
    serving.set_client_tls(tls)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(f"  {TOKEN}\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def services(tiny_llama, tiny_drafter):
    """``(target port, draft servicer, draft port)``: both in this process, both requiring :data:`TOKEN`."""
    with target_in_process(tiny_llama.path, max_sessions=2, max_context=CONTEXT, name="auth-target", auth_token=TOKEN) as tport, \
            draft_in_process(tiny_drafter, tiny_llama.path, max_sessions=2, max_context=CONTEXT,
                             auth_token=TOKEN) as (dservicer, dport):  # fmt: skip
        yield tport, dservicer, dport


def _channel(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    assert TOKEN not in (ei.value.details() or "")
    return ei.value.code(), reason_of(ei.value)


# --------------------------------------------------------------------------------------------
# Raw calls to the internal services


def test_reason_exists():
    assert Reason.UNAUTHENTICATED.value == "UNAUTHENTICATED"


def test_target_rpcs_refuse_calls_without_the_token(services):
    tport = services[0]
    prefill = target_pb2.PrefillRequest(items=[target_pb2.PrefillItem(session_id="intruder", prompt_tokens=[1, 2, 3])])
    verify = target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(session_id="intruder",
                                                                   tree=common_pb2.TokenTree(tokens=[1], parents=[-1]))])
    with _channel(tport) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        calls = {
            "Info": lambda md: stub.Info(target_pb2.TargetInfoRequest(), metadata=md, timeout=10),
            "Prefill": lambda md: stub.Prefill(prefill, metadata=md, timeout=30),
            "Verify": lambda md: list(stub.Verify(iter([verify]), metadata=md, timeout=30)),
            "Release": lambda md: stub.Release(common_pb2.ReleaseRequest(session_ids=["intruder"]), metadata=md, timeout=10),
        }
        for name, call in calls.items():
            for md in BAD_METADATA:
                assert _refused(lambda: call(md)) == (UNAUTH, "UNAUTHENTICATED"), (name, md)
        info = stub.Info(target_pb2.TargetInfoRequest(), metadata=_md(), timeout=10)
        assert info.free_slots == info.max_sessions == 2  # no Prefill ran
        first = stub.Prefill(prefill, metadata=_md(), timeout=30).results[0]  # not SESSION_EXISTS: none was opened
        assert (first.session_id, first.committed_length) == ("intruder", 3)
        (res,) = list(stub.Verify(iter([target_pb2.VerifyRequest(items=[target_pb2.VerifyItem(
            session_id="intruder", tree=common_pb2.TokenTree(tokens=[first.first_token], parents=[-1]))])]), metadata=_md(), timeout=30))
        assert res.results[0].status.code == 0
        assert stub.Release(common_pb2.ReleaseRequest(session_ids=["intruder"]), metadata=_md(), timeout=10).released == 1
        assert stub.Info(target_pb2.TargetInfoRequest(), metadata=[("authorization", f"bearer  {TOKEN} ")],
                         timeout=10).free_slots == 2  # scheme case and spaces do not matter


def test_draft_rpcs_refuse_calls_without_the_token(services):
    from dflash_grpc.wire import tensor_to_proto

    _, servicer, dport = services
    width = servicer.config.feature_size
    item = draft_pb2.ProposeItem(session_id="intruder", features=tensor_to_proto(torch.randn(2, width).to(torch.bfloat16)),
                                 root_token=1, committed_length=2)
    propose = draft_pb2.ProposeRequest(items=[item])
    with _channel(dport) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        calls = {
            "Info": lambda md: stub.Info(draft_pb2.DrafterInfoRequest(), metadata=md, timeout=10),
            "Propose": lambda md: list(stub.Propose(iter([propose]), metadata=md, timeout=30)),
            "Release": lambda md: stub.Release(common_pb2.ReleaseRequest(session_ids=["intruder"]), metadata=md, timeout=10),
        }
        for name, call in calls.items():
            for md in BAD_METADATA:
                assert _refused(lambda: call(md)) == (UNAUTH, "UNAUTHENTICATED"), (name, md)
        assert servicer.num_sessions == 0
        (res,) = list(stub.Propose(iter([propose]), metadata=_md(), timeout=30))
        assert res.results[0].status.code == 0 and servicer.num_sessions == 1
        assert stub.Release(common_pb2.ReleaseRequest(session_ids=["intruder"]), metadata=_md(), timeout=10).released == 1
        assert stub.Info(draft_pb2.DrafterInfoRequest(), metadata=_md(), timeout=10).model.vocab_size > 0


def test_health_stays_open(services):
    for port in (services[0], services[2]):
        with _channel(port) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)  # a response stream, open too
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
        serving.wait_healthy(f"127.0.0.1:{port}", timeout=5)  # the launcher's check, no token


# --------------------------------------------------------------------------------------------
# Reflection


class _Generation(generation_pb2_grpc.GenerationServiceServicer):
    def Info(self, request, context):
        return generation_pb2.ServiceInfo(version="auth")


def _server(**kw):
    def add(server):
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(_Generation(), server)
        return ["dflash_grpc.v1.GenerationService"]

    server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=2, **kw)
    return server, port


def _list_services(port: int, md=()) -> list[str]:
    with _channel(port) as ch:
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter([req]), metadata=md, timeout=5))
        return [s.name for s in resp.list_services_response.service]


@pytest.mark.parametrize("kw", [{}, {"reflection": True}, {"reflection": True, "auth_token": TOKEN}])
def test_reflection_off_by_default_on_when_asked_and_behind_the_token(kw):
    server, port = _server(**kw)
    try:
        if not kw:
            assert _refused(lambda: _list_services(port))[0] == grpc.StatusCode.UNIMPLEMENTED
        elif "auth_token" in kw:
            assert _refused(lambda: _list_services(port)) == (UNAUTH, "UNAUTHENTICATED")
            assert "dflash_grpc.v1.GenerationService" in _list_services(port, _md())
        else:
            names = _list_services(port)
            assert "dflash_grpc.v1.GenerationService" in names and "grpc.health.v1.Health" in names
        with _channel(port) as ch:  # the service itself answers as before (with the token when one is set)
            stub = generation_pb2_grpc.GenerationServiceStub(ch)
            assert stub.Info(generation_pb2.ServiceInfoRequest(), metadata=_md() if "auth_token" in kw else (),
                             timeout=5).version == "auth"
    finally:
        server.stop(None)


def test_make_server_refuses_an_unusable_token():
    for bad in ("", "short", "has space in the token!", "ünïcode-token-0123456789"):
        with pytest.raises(ValueError):
            _server(auth_token=bad)


# --------------------------------------------------------------------------------------------
# Token sources and flags


def _parser(peers: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="svc")
    p.add_argument("--host", default="127.0.0.1")
    serving.add_security_flags(p, peers=peers)
    return p


def _token(argv, warn_open=False):
    p = _parser()
    return serving.auth_token_from_args(p.parse_args(argv), p, warn_open=warn_open)


def test_token_file_is_read_stripped_and_checked(tmp_path, token_file, capsys, monkeypatch):
    monkeypatch.delenv(serving.AUTH_TOKEN_ENV, raising=False)
    assert _token([]) is None
    assert _token(["--auth-token-file", token_file]) == TOKEN
    cases = {
        "open": (f"{TOKEN}\n", 0o644, "may be read or written by group or others (mode 0644): chmod 600"),
        "group-writable": (f"{TOKEN}\n", 0o620, "chmod 600"),
        "empty": (" \n\t", 0o600, "is empty"),
        "short": ("abc123\n", 0o600, "too short"),
        "spaces": ("two words that are long enough\n", 0o600, "printable ASCII without whitespace"),
    }
    for name, (text, mode, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        path.chmod(mode)
        with pytest.raises(ValueError, match=re.escape(message)):
            serving.read_token_file(path)
        with pytest.raises(SystemExit) as ei:
            _token(["--auth-token-file", str(path)])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "--auth-token-file" in err and str(path) in err and message.split(" (")[0] in err
        assert text.strip() not in err or not text.strip()
    with pytest.raises(ValueError, match="cannot read token file"):
        serving.read_token_file(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a regular file"):
        serving.read_token_file(tmp_path)


def test_token_from_the_environment(monkeypatch, token_file, capsys):
    monkeypatch.setenv(serving.AUTH_TOKEN_ENV, f" {TOKEN} \n")
    assert _token([]) == TOKEN
    other = secrets.token_urlsafe(32)
    monkeypatch.setenv(serving.AUTH_TOKEN_ENV, other)
    assert _token(["--auth-token-file", token_file]) == TOKEN  # the file wins
    for bad in ("", "  ", "short"):
        monkeypatch.setenv(serving.AUTH_TOKEN_ENV, bad)
        with pytest.raises(SystemExit):
            _token([])
        assert f"${serving.AUTH_TOKEN_ENV}" in capsys.readouterr().err


def test_open_internal_service_on_the_network_warns(monkeypatch, token_file, caplog):
    monkeypatch.delenv(serving.AUTH_TOKEN_ENV, raising=False)
    caplog.set_level(logging.WARNING, logger="dflash_grpc.serving")
    assert _token(["--host", "0.0.0.0"], warn_open=True) is None
    assert "no auth token" in caplog.text
    caplog.clear()
    assert _token(["--host", "127.0.0.1"], warn_open=True) is None
    assert _token(["--host", "0.0.0.0", "--auth-token-file", token_file], warn_open=True) == TOKEN
    assert _token(["--host", "0.0.0.0"]) is None  # the orchestrator does not warn
    assert caplog.text == ""


def test_every_service_has_the_flags():
    from draft_service.__main__ import build_parser as draft_parser
    from orchestrator.__main__ import build_parser as orchestrator_parser
    from target_service.__main__ import build_parser as target_parser

    for build, required in ((target_parser, []), (draft_parser, []), (orchestrator_parser, ["--target", "t:1"])):
        args = build().parse_args([*required, "--auth-token-file", "/t", "--reflection"])
        assert (args.auth_token_file, args.reflection) == ("/t", True)
        args = build().parse_args(required)
        assert (args.auth_token_file, args.reflection) == (None, False)


def test_target_and_draft_main_wire_the_token(monkeypatch, tiny_llama, tiny_drafter, token_file):
    """``main()`` of both services (tiny models, in this process; serve_forever replaced by a few
    raw calls): ``--auth-token-file`` guards the port, ``--reflection`` turns reflection on."""
    import draft_service.__main__ as draft_main
    import target_service.__main__ as target_main

    monkeypatch.delenv(serving.AUTH_TOKEN_ENV, raising=False)
    monkeypatch.setattr(serving, "setup_logging", lambda level=None: None)  # keep pytest's log capture
    seen = {}

    def serve_forever(server, health, name, port, **kwargs):
        try:
            with _channel(port) as ch:
                info = ch.unary_unary(f"/dflash_grpc.v1.{name.title()}Service/Info")
                seen[name] = (_refused(lambda: info(b"", timeout=10)), len(info(b"", metadata=_md(), timeout=10)) > 0,
                              len(_list_services(port, _md())) > 0)
        finally:
            server.stop(None)

    monkeypatch.setattr(serving, "serve_forever", serve_forever)
    common = ["--port", "0", "--max-sessions", "1", "--max-context", "32", "--auth-token-file", token_file, "--reflection"]
    target_main.main(["--model", tiny_llama.path, *common])
    draft_main.main(["--drafter", tiny_drafter, "--target", tiny_llama.path, *common])
    assert seen == {name: ((UNAUTH, "UNAUTHENTICATED"), True, True) for name in ("target", "draft")}


def test_the_token_is_never_logged(services, token_file, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    tport, _, dport = services
    for port in (tport, dport):
        for md in BAD_METADATA:
            with _channel(port) as ch:
                _refused(lambda: ch.unary_unary("/dflash_grpc.v1.TargetService/Info" if port == tport
                                                else "/dflash_grpc.v1.DraftService/Info")(b"", metadata=md, timeout=10))
    server, port = _server(auth_token=TOKEN, reflection=True)
    server.stop(None)
    assert _token(["--auth-token-file", token_file]) == TOKEN
    monkeypatch.setenv(serving.AUTH_TOKEN_ENV, TOKEN)
    assert _token([]) == TOKEN
    monkeypatch.setenv(serving.AUTH_TOKEN_ENV, TOKEN[:10])  # too short: refused, not echoed
    with pytest.raises(SystemExit):
        _token([])
    refused = [r for r in caplog.records if r.getMessage() == "unauthenticated call refused"]
    assert len(refused) == 2 * len(BAD_METADATA) and {r.why for r in refused} >= {"no token", "wrong token"}
    text = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    assert TOKEN not in text and TOKEN[:10] not in text and TOKEN[:-1] not in text


# --------------------------------------------------------------------------------------------
# End to end: the orchestrator with the token


def test_orchestrator_with_the_token_generates_speculatively(services, tiny_llama, token_file):
    import client as sdk
    from client.launcher import ServiceGroup, free_ports

    tport, _, dport = services
    (oport,) = free_ports(1)
    orch = module_service("orchestrator", "orchestrator", oport, "--target", f"127.0.0.1:{tport}", "--draft",
                          f"127.0.0.1:{dport}", "--model", tiny_llama.path, "--max-tokens", "8", "--auth-token-file", token_file)
    with ServiceGroup([orch], grace=3.0, forward_output=False) as group:
        group.wait_healthy(timeout=60)
        with sdk.Client(orch.address, timeout=60) as c:  # the public API needs no token
            r = c.generate(tokens=[5, 6, 7], max_tokens=6, ignore_eos=True)
            assert len(r.token_ids) == 6 and r.finish_reason == "length"
            assert r.stats.drafts > 0 and r.stats.draft_fallbacks == 0  # the drafter took the token too
            assert c.info().drafter.model is not None


def test_orchestrator_without_the_token_stops_with_a_clear_error(services, tiny_llama, monkeypatch):
    monkeypatch.delenv(serving.AUTH_TOKEN_ENV, raising=False)
    argv = [sys.executable, "-m", "orchestrator", "--target", f"127.0.0.1:{services[0]}", "--model", tiny_llama.path,
            "--port", "0"]  # the default --target-wait is 120 s: the refusal must end the wait at once
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "refused this orchestrator's token (UNAUTHENTICATED)" in out.stderr


def test_token_and_mutual_tls_together(tiny_llama, certs):
    """Orchestrator -> target over mutual TLS with the token (``TargetPeer`` follows the process-wide
    channel TLS and metadata); certificates of tests/test_tls.py's ``certs``."""
    from orchestrator.peers import TargetPeer

    s, c = _files(certs, "server"), _files(certs, "client")
    tls = TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"])

    def info(**kw):
        peer = TargetPeer(f"localhost:{port}")
        try:
            return peer.info(timeout=5)
        finally:
            peer.close()

    with target_in_process(tiny_llama.path, max_sessions=1, max_context=32, tls=tls, name="auth-mtls", auth_token=TOKEN) as port:
        serving.set_client_tls(TlsConfig(**c))
        assert _refused(info) == (UNAUTH, "UNAUTHENTICATED")  # TLS is fine, the token missing
        serving.set_client_metadata([(serving.AUTH_METADATA_KEY, serving.bearer(TOKEN))])
        assert info().max_context == 32
        serving.set_client_tls(TlsConfig(ca=c["ca"]))  # the token without a client certificate: refused by TLS
        assert _refused(info)[0] == grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------------------------
# dflash-grpc serve / demo and the launcher


def test_private_token_file():
    from client.launcher import private_token_file

    with private_token_file() as path:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        token = serving.read_token_file(path)
        assert len(token) >= 43
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    with private_token_file() as other:
        assert serving.read_token_file(other) != token


def test_dflash_services_pass_the_token_file_to_all_three():
    from client.launcher import dflash_services

    svcs = dflash_services("m.gguf", "d.gguf", ports=(1, 2, 3), auth_token_file="/run/t")
    for s in svcs:
        i = s.argv.index("--auth-token-file")
        assert s.argv[i + 1] == "/run/t"
    assert all("--auth-token-file" not in s.argv for s in dflash_services("m.gguf", "d.gguf", ports=(1, 2, 3)))


@pytest.mark.parametrize("command", [["serve"], ["demo", "--problem", "0"]])
def test_serve_and_demo_make_a_private_token_by_default(command, monkeypatch, capsys, tmp_path, token_file):
    import client.cli as cli

    seen = []

    def fake_services(model, drafter, **kw):
        path = kw["auth_token_file"]
        seen.append((path, os.path.exists(path) and stat.S_IMODE(os.stat(path).st_mode), serving.read_token_file(path)))
        raise OSError("stand-in: no services")

    monkeypatch.setattr(cli, "_model_paths", lambda args: ("m.gguf", "d.gguf"))
    monkeypatch.setattr(cli, "dflash_services", fake_services)
    assert cli.main(command) == 1
    (path, mode, token), = seen
    assert mode == 0o600 and len(token) >= 43 and not os.path.exists(path)  # removed at exit
    assert token not in capsys.readouterr().err
    assert cli.main([*command, "--auth-token-file", token_file]) == 1
    assert seen[1] == (token_file, 0o600, TOKEN) and os.path.exists(token_file)  # the user's file stays
    bad = tmp_path / "open"
    bad.write_text(TOKEN)
    bad.chmod(0o644)
    assert cli.main([*command, "--auth-token-file", str(bad)]) == 1 and len(seen) == 2
    err = capsys.readouterr().err
    assert "error: --auth-token-file:" in err and "chmod 600" in err and TOKEN not in err
