"""Transport defaults: TLS and mutual TLS (servers of ``make_server``, ``serving.channel``, the SDK,
the CLI, the services' flags, orchestrator -> target over mutual TLS), message-size limits
(RESOURCE_EXHAUSTED both ways) and undecodable requests (INVALID_ARGUMENT, not INTERNAL).

Certificates are made here with ``cryptography``: a CA, a server certificate for 127.0.0.1 /
localhost, a client certificate, and a second CA with its own client certificate.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dflash_grpc import serving
from dflash_grpc.transport import GRPC_OPTIONS, MAX_MESSAGE_BYTES, TlsConfig, TlsError, is_loopback
from dflash_grpc.v1 import common_pb2, generation_pb2, generation_pb2_grpc

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

import client as sdk  # noqa: E402
from client.cli import main  # noqa: E402
from tests.conftest import module_service, target_in_process  # noqa: E402

CHECK = "/grpc.health.v1.Health/Check"


# --------------------------------------------------------------------------------------------
# Certificates


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name: x509.Name, issuer_key, *, ca: bool = False, sans=(), usage=None):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                                          encipher_only=False, decipher_only=False), critical=True)  # fmt: skip
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usage:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path, cert, key) -> None:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.parent.joinpath(path.name + "-key.pem").write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A directory in ``serve --tls-dir`` layout (ca, server, client) plus ``other-ca`` / ``other-client``."""
    d = tmp_path_factory.mktemp("certs")
    for prefix in ("", "other-"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert(f"{prefix}test CA", ca_key, _name(f"{prefix}test CA"), ca_key, ca=True)
        _write(d / f"{prefix}ca", ca, None)
        client_key = ec.generate_private_key(ec.SECP256R1())
        client = _cert(f"{prefix}client", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        _write(d / f"{prefix}client", client, client_key)
        if not prefix:
            server_key = ec.generate_private_key(ec.SECP256R1())
            sans = [x509.DNSName("localhost"), x509.DNSName("target.internal"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            server = _cert("server", server_key, ca.subject, ca_key, sans=sans, usage=ExtendedKeyUsageOID.SERVER_AUTH)
            _write(d / "server", server, server_key)
    return d


def _files(certs, role="client", ca="ca.pem"):
    return dict(ca=str(certs / ca), cert=str(certs / f"{role}.pem"), key=str(certs / f"{role}-key.pem"))


@pytest.fixture(autouse=True)
def _plaintext_after():
    """Every test leaves the process-wide channel TLS as it found it (plaintext)."""
    yield
    serving.set_client_tls(None)


# --------------------------------------------------------------------------------------------
# Servers


class _Generation(generation_pb2_grpc.GenerationServiceServicer):
    def Info(self, request, context):
        return generation_pb2.ServiceInfo(target=common_pb2.ModelInfo(model_name="tls-test"), version="tls")


@pytest.fixture()
def start():
    """``start(tls)``: a real server (health + a minimal GenerationService) via make_server; its address."""
    servers = []

    def _start(tls: TlsConfig | None) -> str:
        def add(server):
            generation_pb2_grpc.add_GenerationServiceServicer_to_server(_Generation(), server)
            return ["dflash_grpc.v1.GenerationService"]

        server, _, port = serving.make_server(add, "127.0.0.1:0", max_workers=2, tls=tls)
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield _start
    for s in servers:
        s.stop(None)


def _check(address: str, tls: TlsConfig | None) -> int:
    with serving.channel(address, tls=tls) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status


def _code(address: str, tls: TlsConfig | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        _check(address, tls)
    return ei.value.code()


SERVING = health_pb2.HealthCheckResponse.SERVING


def test_tls_with_the_ca_works_without_it_fails(certs, start):
    f = _files(certs, "server")
    address = start(TlsConfig(cert=f["cert"], key=f["key"]))
    assert _check(address, TlsConfig(ca=f["ca"])) == SERVING
    assert _check(address, TlsConfig(ca=f["ca"], server_name="target.internal")) == SERVING
    assert _code(address, TlsConfig()) == grpc.StatusCode.UNAVAILABLE  # system roots do not know the test CA
    assert _code(address, TlsConfig(ca=str(certs / "other-ca.pem"))) == grpc.StatusCode.UNAVAILABLE
    assert _code(address, TlsConfig(ca=f["ca"], server_name="evil.example")) == grpc.StatusCode.UNAVAILABLE
    assert _code(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port


def test_mutual_tls_requires_a_client_certificate_of_the_ca(certs, start):
    s = _files(certs, "server")
    address = start(TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"]))
    c = _files(certs, "client")
    assert _check(address, TlsConfig(**c)) == SERVING
    assert _code(address, TlsConfig(ca=c["ca"])) == grpc.StatusCode.UNAVAILABLE  # no client certificate
    other = _files(certs, "other-client")
    assert _code(address, TlsConfig(ca=c["ca"], cert=other["cert"], key=other["key"])) == grpc.StatusCode.UNAVAILABLE


def test_process_wide_client_tls_drives_channel_and_wait_healthy(certs, start):
    s = _files(certs, "server")
    address = start(TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"]))
    with pytest.raises(TimeoutError):
        serving.wait_healthy(address, timeout=0.5)  # plaintext by default
    serving.set_client_tls(TlsConfig(**_files(certs, "client")))
    serving.wait_healthy(address, timeout=5)
    with serving.channel(address) as ch:  # the orchestrator's peers open theirs like this
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status == SERVING
    assert serving.client_tls().cert.endswith("client.pem")


def test_tls_config_errors(certs, tmp_path):
    with pytest.raises(TlsError, match="go together"):
        TlsConfig(cert=str(certs / "client.pem"))
    with pytest.raises(TlsError, match="cannot read"):
        TlsConfig(ca=str(tmp_path / "missing.pem")).check()
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(TlsError, match="not PEM"):
        TlsConfig(ca=str(tmp_path / "junk.pem")).check()
    with pytest.raises(TlsError, match="needs a certificate"):
        TlsConfig(ca=str(certs / "ca.pem")).server_credentials()
    d = TlsConfig.from_dir(certs, "server")
    assert (d.cert, d.key, d.ca) == (str(certs / "server.pem"), str(certs / "server-key.pem"), str(certs / "ca.pem"))
    assert TlsConfig.from_dir(certs, "client", server_name="x").check().server_name == "x"


# --------------------------------------------------------------------------------------------
# SDK and CLI


def test_sdk_client_tls_options(certs, start):
    s = _files(certs, "server")
    address = start(TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"]))
    c = _files(certs, "client")
    with sdk.Client(address, timeout=5, tls_ca=c["ca"], tls_cert=c["cert"], tls_key=c["key"]) as cl:
        assert cl.info().target.model_name == "tls-test"
    with sdk.Client(address, timeout=5, tls_ca=c["ca"], tls_cert=c["cert"], tls_key=c["key"], tls_server_name="localhost") as cl:
        assert cl.info().version == "tls"
    with sdk.Client(address, timeout=5, tls_ca=c["ca"]) as cl, pytest.raises(sdk.UnavailableError):
        cl.info()
    with sdk.Client(address, timeout=5) as cl, pytest.raises(sdk.UnavailableError):
        cl.info()
    with pytest.raises(sdk.InvalidArgumentError, match="go together"):
        sdk.Client(address, tls_cert=c["cert"])

    async def run():
        async with sdk.AsyncClient(address, timeout=5, tls_ca=c["ca"], tls_cert=c["cert"], tls_key=c["key"]) as ac:
            return (await ac.info()).target.model_name

    import asyncio

    assert asyncio.run(run()) == "tls-test"


def test_cli_connection_tls_flags(certs, start, capsys):
    s = _files(certs, "server")
    address = start(TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"]))
    c = _files(certs, "client")
    argv = ["info", "--json", "--address", address, "--timeout", "5", "--tls-ca", c["ca"], "--tls-cert", c["cert"],
            "--tls-key", c["key"], "--tls-server-name", "localhost"]  # fmt: skip
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["target"]["model_name"] == "tls-test"
    assert main(["info", "--address", address, "--timeout", "5", "--tls-ca", c["ca"]]) == 2  # no client certificate
    assert "UNAVAILABLE" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The services' flags


def _parse(argv, peers=False):
    p = argparse.ArgumentParser(prog="svc", exit_on_error=False)
    p.add_argument("--host", default="127.0.0.1")
    serving.add_tls_flags(p, peers=peers)
    args = p.parse_args(argv)
    return serving.server_tls_from_args(args, p), (serving.peer_tls_from_args(args, p) if peers else None)


def test_service_flags(certs, capsys):
    s = _files(certs, "server")
    assert _parse([]) == (None, None)
    assert _parse(["--host", "localhost"]) == (None, None)
    with pytest.raises(SystemExit):
        _parse(["--host", "0.0.0.0"])
    assert "not a loopback address" in capsys.readouterr().err
    assert _parse(["--host", "0.0.0.0", "--insecure"]) == (None, None)
    tls, _ = _parse(["--host", "0.0.0.0", "--tls-cert", s["cert"], "--tls-key", s["key"], "--tls-client-ca", s["ca"]])
    assert tls == TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"])
    for bad in (["--tls-cert", s["cert"]], ["--tls-client-ca", s["ca"]], ["--tls-cert", "/nonexistent", "--tls-key", s["key"]]):
        with pytest.raises(SystemExit):
            _parse(bad)
    c = _files(certs, "client")
    _, peer = _parse(["--peer-tls-ca", c["ca"], "--peer-tls-cert", c["cert"], "--peer-tls-key", c["key"],
                      "--peer-tls-server-name", "target.internal"], peers=True)  # fmt: skip
    assert peer == TlsConfig(cert=c["cert"], key=c["key"], ca=c["ca"], server_name="target.internal")
    with pytest.raises(SystemExit):
        _parse(["--peer-tls-cert", c["cert"]], peers=True)


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("localhost", True), ("::1", True),
                                           ("[::1]", True), ("0.0.0.0", False), ("::", False), ("", False),
                                           ("10.0.0.1", False), ("example.com", False)])  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_serve_tls_dir_passes_flags_to_the_services(certs, monkeypatch, capsys):
    import client.cli as cli

    seen = {}

    def fake_serve(args, extra):
        seen.update(extra=extra, orch=args.orchestrator_args)
        return 0

    monkeypatch.setattr(cli, "_cmd_serve", fake_serve)
    assert main(["serve", "--tls-dir", str(certs), "--tls-server-name", "target.internal", "--orchestrator-args", "--x 1"]) == 0
    assert seen["extra"][-6:] == ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server-key.pem"),
                                  "--tls-client-ca", str(certs / "ca.pem")]  # fmt: skip
    assert f"--peer-tls-cert {certs / 'client.pem'}" in seen["orch"] and seen["orch"].endswith("--peer-tls-server-name target.internal --x 1")
    assert serving.client_tls() == TlsConfig.from_dir(certs, "client", server_name="target.internal")
    assert "mutual TLS: clients need --tls-ca" in capsys.readouterr().err
    assert main(["serve", "--tls-dir", str(certs / "nowhere")]) == 1
    assert "--tls-dir: cannot read TLS file" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Orchestrator -> target over mutual TLS (real processes, tiny model)


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """The shared tiny target's path (tests/conftest.py)."""
    return tiny_llama.path


@pytest.fixture(scope="module")
def mtls_target(certs, tiny):
    """An in-process target service (tiny model, reference engine) serving mutual TLS; its port."""
    s = _files(certs, "server")
    tls = TlsConfig(cert=s["cert"], key=s["key"], ca=s["ca"])
    with target_in_process(tiny, max_sessions=2, max_context=64, tls=tls, name="tls-target") as port:
        yield port


def test_target_peer_over_mutual_tls(certs, mtls_target):
    """The orchestrator's channel to the target (``TargetPeer``, ``serving.channel``) follows set_client_tls."""
    from orchestrator.peers import TargetPeer

    address = f"localhost:{mtls_target}"
    serving.set_client_tls(TlsConfig(ca=str(certs / "ca.pem")))  # TLS, but no client certificate
    with pytest.raises(grpc.RpcError) as ei:
        TargetPeer(address).info(timeout=3)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    serving.set_client_tls(TlsConfig(**_files(certs, "client")))
    peer = TargetPeer(address)
    try:
        assert peer.wait_info(5).max_context == 64
    finally:
        peer.close()


@pytest.mark.slow
def test_orchestrator_process_over_mutual_tls(certs, tiny, mtls_target):
    """``python -m orchestrator`` with --peer-tls-* to the mutual-TLS target and --tls-* on its own
    port; the SDK generates through it over mutual TLS."""
    from client.launcher import ServiceGroup, free_ports

    (oport,) = free_ports(1)
    s, c = _files(certs, "server"), _files(certs, "client")
    orch = module_service("orchestrator", "orchestrator", oport, "--target", f"127.0.0.1:{mtls_target}", "--model", tiny,
                          "--tls-cert", s["cert"], "--tls-key", s["key"], "--tls-client-ca", s["ca"],
                          "--peer-tls-ca", c["ca"], "--peer-tls-cert", c["cert"], "--peer-tls-key", c["key"])  # fmt: skip
    serving.set_client_tls(TlsConfig(**c))  # the group's health checks
    with ServiceGroup([orch], grace=3.0) as group:
        group.wait_healthy(timeout=60)
        with sdk.Client(f"127.0.0.1:{oport}", timeout=30, tls_ca=c["ca"], tls_cert=c["cert"], tls_key=c["key"]) as cl:
            r = cl.generate(tokens=[5, 6, 7], max_tokens=4, ignore_eos=True)
            assert len(r.token_ids) == 4 and r.finish_reason == "length"
        with sdk.Client(f"127.0.0.1:{oport}", timeout=5, tls_ca=c["ca"]) as cl, pytest.raises(sdk.UnavailableError):
            cl.info()  # the public port is mutual TLS too


# --------------------------------------------------------------------------------------------
# Message size and undecodable requests


def test_oversized_messages_are_resource_exhausted(start):
    address = start(None)
    big = bytes(MAX_MESSAGE_BYTES + 1)
    unlimited = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(address, options=unlimited) as ch:  # the server's receive limit
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary(CHECK)(big, timeout=30)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with serving.channel(address) as ch:  # the project's channels refuse to send it
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary(CHECK)(big, timeout=30)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with sdk.Client(address, timeout=30) as cl:  # so does the SDK's (raw bytes: a 256 MiB prompt takes seconds to encode)
        with pytest.raises(grpc.RpcError) as ei:
            cl._channel.unary_unary(CHECK)(big, timeout=30)
        assert sdk.from_rpc_error(ei.value).code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert cl.info().version == "tls"  # the server still answers
    assert dict(GRPC_OPTIONS) == {"grpc.max_send_message_length": MAX_MESSAGE_BYTES,
                                  "grpc.max_receive_message_length": MAX_MESSAGE_BYTES}  # fmt: skip


def test_undecodable_request_is_invalid_argument(start):
    address = start(None)
    with serving.channel(address) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary(CHECK)(b"\xff\xff\xff", timeout=5)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as ei:
            list(ch.unary_stream("/dflash_grpc.v1.GenerationService/Generate")(b"\x0a\x02\xc3\x28", timeout=5))  # bad UTF-8
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status == SERVING
