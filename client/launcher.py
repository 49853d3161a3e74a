"""Start, watch and stop a group of service processes (what ``dflash-grpc serve`` and ``demo`` run).

Each service is a child process in a session of its own (so a terminal's Ctrl-C reaches only the
parent, which then stops the children in order). Children's stderr is inherited; their stdout is
read by a thread that drops the ``READY <name> port=<port>`` lines and forwards everything else
to our stderr, so that the parent's stdout stays clean for generated text.

Typical use::

    services = dflash_services(model, drafter, ports=free_ports(3))
    with ServiceGroup(services) as group:      # start(); stop() on exit
        group.wait_healthy(timeout=600)
        group.supervise()                      # restart crashed services until Ctrl-C

:meth:`ServiceGroup.supervise` restarts a service whose process exits (same command line), with
exponential backoff, and gives up (stops the group, raises :class:`RestartBudgetExhausted`) when
one crashes too often.

**The internal services' token.** ``dflash_services(..., auth_token_file=PATH)`` passes
``--auth-token-file PATH`` to all three services: the target and draft services then answer any
call without that token UNAUTHENTICATED (health checks excepted) and the orchestrator sends it.
:func:`private_token_file` makes one: a fresh ``secrets.token_urlsafe(32)`` in a file only this
user may read, in a private temporary directory removed when the block ends. ``dflash-grpc
serve``, ``demo`` and ``bench`` do this unless given ``--auth-token-file``::

    with private_token_file() as token_file:
        services = dflash_services(model, drafter, auth_token_file=token_file)
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from dflash_grpc.defaults import DEFAULT_HOST, DRAFT_PORT, ORCHESTRATOR_PORT, TARGET_PORT

__all__ = ["DEFAULT_GRACE", "MPS_CONTROL", "MpsUnavailable", "RestartBudgetExhausted", "RestartPolicy", "Service",
           "ServiceExited", "ServiceGroup", "dflash_services", "free_ports", "private_mps", "private_token_file"]

#: Seconds :meth:`ServiceGroup.stop` gives each service between SIGTERM and SIGKILL by default: the
#: services' default ``--shutdown-timeout`` (30 s: requests in flight may finish) plus a margin for
#: releasing sessions and exiting.
DEFAULT_GRACE = 40.0


@dataclass
class Service:
    """One child process: its name, its command line, and the ``host:port`` its health service answers on."""

    name: str
    argv: list[str]
    address: str
    env: dict[str, str] = field(default_factory=dict)  # added to the parent's environment


class ServiceExited(RuntimeError):
    """A service process exited while it should have been running."""

    def __init__(self, name: str, returncode: int | None):
        how = f"was killed by signal {-returncode}" if returncode is not None and returncode < 0 else f"exited with code {returncode}"
        super().__init__(f"service {name!r} {how}")
        self.name = name
        self.returncode = returncode


class RestartBudgetExhausted(ServiceExited):
    """A service crashed more often than :class:`RestartPolicy` allows; the group was stopped."""

    def __init__(self, name: str, returncode: int | None, restarts: int, window: float):
        super().__init__(name, returncode)
        self.args = (f"{self.args[0]} and was restarted {restarts} times in the last {window:g} s; giving up",)
        self.restarts = restarts


@dataclass(frozen=True)
class RestartPolicy:
    """How :meth:`ServiceGroup.supervise` restarts a crashed service.

    The n-th restart within ``window`` seconds waits ``min(max_backoff, backoff * 2**(n-1))``
    seconds first; a service that would need more than ``max_restarts`` restarts within
    ``window`` seconds is not restarted: the group stops.
    """

    backoff: float = 0.5
    max_backoff: float = 10.0
    max_restarts: int = 5
    window: float = 60.0

    def delay(self, n: int) -> float:
        """Seconds to wait before the ``n``-th recent restart (n >= 1)."""
        return min(self.max_backoff, self.backoff * 2 ** max(0, n - 1))


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free on ``host`` a moment ago (bound to port 0 together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@contextlib.contextmanager
def private_token_file(token: str | None = None) -> Iterator[str]:
    """A file holding ``token`` (default: a fresh ``secrets.token_urlsafe(32)``, 43 characters),
    for ``--auth-token-file``; yields its path.

    The file (mode 0600) lies in a new directory (mode 0700, ``tempfile.mkdtemp``) that only this
    user can enter; both are removed when the block ends (a SIGKILL of this process leaves them
    behind, still private). The token itself is never printed or logged.
    """
    token = secrets.token_urlsafe(32) if token is None else token
    d = tempfile.mkdtemp(prefix="dflash-token-")
    try:
        path = os.path.join(d, "auth-token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(token + "\n")
        yield path
    finally:
        shutil.rmtree(d, ignore_errors=True)


#: NVIDIA's MPS control program (part of the driver's utilities), run by :func:`private_mps`
MPS_CONTROL = "nvidia-cuda-mps-control"


class MpsUnavailable(RuntimeError):
    """:func:`private_mps` could not start an MPS control daemon (no program, or it failed)."""


@contextlib.contextmanager
def private_mps(control: str = MPS_CONTROL, timeout: float = 30.0) -> Iterator[dict[str, str]]:
    """An NVIDIA MPS (Multi-Process Service) control daemon of this group's own, for the block.

    Yields the environment the services must start with (``CUDA_MPS_PIPE_DIRECTORY`` and
    ``CUDA_MPS_LOG_DIRECTORY``, both in a fresh private temporary directory): CUDA processes with
    it become clients of this daemon's one MPS server, so the target's and the drafter's kernels
    share the GPU in one context instead of time slices of two. Processes without it (the rest of
    the machine) are not its clients. On exit the daemon is told to ``quit`` (after the services
    have stopped: stop them inside the block) and the directory is removed. A parent killed
    outright (SIGKILL) leaves the daemon and its directory behind: ``CUDA_MPS_PIPE_DIRECTORY=<its
    pipe directory> nvidia-cuda-mps-control`` with ``quit`` on stdin stops it.

    Why: on H200s the three services at one stream made 1,416-1,773 tok/s with the default tree
    and 1,641-2,025 under MPS (four calls, alternating: 1.16-1.18x per call), the drafter's step
    0.37-0.45 -> 0.25-0.31 ms of device time; no claim at 8-64 streams
    (``benchmarks/gpu/step/run27-mps``). See docs/ARCHITECTURE.md, "Measuring".

    Raises:
        MpsUnavailable: ``control`` is not on ``PATH``, or ``control -d`` failed or timed out.
    """
    exe = shutil.which(control)
    if exe is None:
        raise MpsUnavailable(f"{control} is not on PATH: MPS needs the NVIDIA driver's utilities")
    root = tempfile.mkdtemp(prefix="dflash-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    full = {**os.environ, **env}
    try:
        for d in env.values():
            os.makedirs(d, mode=0o700)
        done = subprocess.run([exe, "-d"], env=full, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        shutil.rmtree(root, ignore_errors=True)
        raise MpsUnavailable(f"{control} -d did not start: {e}") from None
    if done.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise MpsUnavailable(f"{control} -d exited with {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}")
    try:
        yield env
    finally:
        try:
            subprocess.run([exe], input="quit\n", env=full, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            pass   # (a daemon that does not answer is left to the machine; nothing of ours waits on it)
        shutil.rmtree(root, ignore_errors=True)


def drafter_feature_layers(path: str) -> list[int] | None:
    """The target layers a drafter GGUF reads (``{arch}.dflash.target_layer_ids``, or a checkpoint
    directory's ``dflash_config.target_layer_ids`` in config.json; the key
    :func:`draft_service.gguf_io.read_drafter_config` reads; read here from the metadata alone, so
    the ``dflash-grpc`` process does not import the drafter's torch modules), or None when the file
    cannot be read or holds no such key (the draft service reports the problem itself).

    :func:`dflash_services` starts the target with them (``--feature-layers``), so its step graphs
    are captured for them at start: otherwise the first speculative request asks for new taps and
    the target recaptures every graph inside that request (logged as "new feature layers
    requested"), a stall of that request, and of the first speculative configuration that
    ``dflash-grpc bench`` times)."""
    from runtime.gguf_loader import open_gguf

    try:
        if os.path.isdir(path):   # a z-lab checkpoint directory: config.json (derived ids: the draft service's)
            with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
                ids = (json.load(f).get("dflash_config") or {}).get("target_layer_ids")
        else:
            ids = open_gguf(path).get("{arch}.dflash.target_layer_ids")
    except Exception:  # noqa: BLE001 - not readable: the draft service will say why
        return None
    if ids is None:
        return None
    ids = ids if isinstance(ids, (list, tuple)) else [ids]
    return [int(i) for i in ids]


def dflash_services(
    model: str,
    drafter: str | None,
    *,
    ports: Sequence[int] = (TARGET_PORT, DRAFT_PORT, ORCHESTRATOR_PORT),
    host: str = DEFAULT_HOST,
    device: str | None = None,
    log_level: str | None = None,
    extra: Sequence[str] = (),
    target_args: Sequence[str] = (),
    draft_args: Sequence[str] = (),
    orchestrator_args: Sequence[str] = (),
    auth_token_file: str | None = None,
    colocate: bool = False,
    http_port: int = 0,
    env: dict[str, str] | None = None,
) -> list[Service]:
    """The three dflash-grpc services (target, draft, orchestrator), in start order; with
    ``colocate`` two processes (draft, then the orchestrator running the target in its own
    process: ``--target in-process``, :mod:`orchestrator.local_target`).

    Args:
        model: target GGUF path (target ``--model``, draft ``--target``, orchestrator ``--model``).
        drafter: drafter GGUF path; None leaves the draft service out (the orchestrator then
            decodes autoregressively).
        ports: ``(target, draft, orchestrator)`` ports (default: the ``port`` defaults of
            ``TargetConfig``, ``DraftConfig``, ``OrchestratorConfig``, held in
            :mod:`dflash_grpc.defaults`).
        host: interface the services listen on (``--host`` of each; default: their ``host`` default).
        device: ``--device`` of the target and draft services (None: their default).
        log_level: ``DFLASH_LOG_LEVEL`` of every child (None: inherited, WARNING by default).
        extra: flags given to every service.
        target_args, draft_args, orchestrator_args: flags given to one service.
        auth_token_file: ``--auth-token-file`` of every service (see :func:`private_token_file`):
            the target and draft services take calls carrying that token only, the
            orchestrator sends it. None: no token (anyone who reaches their ports may call them).
        colocate: run the target inside the orchestrator's process (``target_args``, ``device``
            and ``extra`` go to it through ``--target-args``; the target port is unused).
        http_port: the orchestrator's ``--http-port`` (its OpenAI-compatible HTTP front door; 0: off).
        env: more environment of every child (e.g. :func:`private_mps`'s).
    """
    target_port, draft_port, orch_port = ports
    if drafter is not None and not any(a == "--feature-layers" or a.startswith("--feature-layers=") for a in target_args):
        layers = drafter_feature_layers(drafter)
        if layers:   # graphs captured for the drafter's taps at start: no recapture at the first request
            target_args = ["--feature-layers", ",".join(map(str, layers)), *target_args]
    py = sys.executable
    token = ["--auth-token-file", auth_token_file] if auth_token_file is not None else []
    common = ["--host", host, *token, *extra]
    dev = ["--device", device] if device else []
    env = {**(env or {}), **({"DFLASH_LOG_LEVEL": log_level.upper()} if log_level else {})}
    target_addr, draft_addr = f"{host}:{target_port}", f"{host}:{draft_port}"
    services = [] if colocate else [
        Service(
            "target",
            [py, "-m", "target_service", "--model", model, "--port", str(target_port), *dev, *common, *target_args],
            target_addr,
            env,
        )
    ]
    if drafter is not None:
        services.append(
            Service(
                "draft",
                [py, "-m", "draft_service", "--drafter", drafter, "--target", model, "--port", str(draft_port),
                 *dev, *common, *draft_args],
                draft_addr,
                env,
            )  # fmt: skip
        )
    if colocate:
        orch = [py, "-m", "orchestrator", "--target", "in-process",
                f"--target-args={shlex.join(['--model', model, *dev, *extra, *target_args])}"]
    else:
        orch = [py, "-m", "orchestrator", "--target", target_addr]
    if drafter is not None:
        orch += ["--draft", draft_addr]
    orch += ["--model", model, "--port", str(orch_port), *common, *orchestrator_args]
    if http_port:
        orch += ["--http-port", str(http_port)]
    services.append(Service("orchestrator", orch, f"{host}:{orch_port}", env))
    return services


class ServiceGroup:
    """A group of service processes started, health-checked and stopped together.

    Args:
        services: what to run, in start order (stopped in reverse order, one after the other).
        grace: seconds :meth:`stop` waits after SIGTERM before it sends SIGKILL, per service; at
            least the services' ``--shutdown-timeout`` plus a few seconds (:data:`DEFAULT_GRACE`).
        forward_output: forward the children's stdout (minus READY lines) to our stderr;
            False discards it.
    """

    def __init__(self, services: Sequence[Service], *, grace: float = DEFAULT_GRACE, forward_output: bool = True):
        names = [s.name for s in services]
        if len(set(names)) != len(names):
            raise ValueError(f"service names must be distinct: {names}")
        self.services = list(services)
        self.grace = grace
        self.forward_output = forward_output
        self.procs: dict[str, subprocess.Popen] = {}
        self._readers: list[threading.Thread] = []
        #: restarts done by :meth:`supervise`, per service
        self.restarts: dict[str, int] = {s.name: 0 for s in services}
        self._lock = threading.Lock()   # start/restart vs stop
        self._stopping = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start every service (in order, without waiting for health). Idempotent per service."""
        with self._lock:
            self._stopping = False
            for svc in self.services:
                if svc.name not in self.procs:
                    self._spawn(svc)

    def _spawn(self, svc: Service) -> subprocess.Popen:
        proc = subprocess.Popen(
            svc.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **svc.env},
            start_new_session=True,
            text=True,
            errors="replace",
        )
        self.procs[svc.name] = proc
        t = threading.Thread(target=self._pump, args=(proc,), name=f"pump-{svc.name}", daemon=True)
        t.start()
        self._readers.append(t)
        return proc

    def restart(self, name: str) -> subprocess.Popen | None:
        """Start service ``name`` again with the same command line (stopping the old process
        first if it still runs); None when the group is stopping."""
        svc = next(s for s in self.services if s.name == name)
        old = self.procs.get(name)
        if old is not None and old.poll() is None:
            _signal_group(old, signal.SIGTERM)
            try:
                old.wait(timeout=self.grace)
            except subprocess.TimeoutExpired:
                _signal_group(old, signal.SIGKILL)
                old.wait()
        with self._lock:
            if self._stopping:
                return None
            return self._spawn(svc)

    def supervise(
        self,
        stop: threading.Event | None = None,
        *,
        policy: RestartPolicy | None = None,
        on_restart: Callable[[Service, int], None] | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        """Watch the services until ``stop`` is set (or the group is stopped); restart any that
        exits, with the same command line.

        Each restart prints ``service 'NAME' exited with code C; restarting (restart N)`` on
        stderr (N counts this service's restarts since the group started), waits the policy's
        backoff, starts the service again and calls ``on_restart(service, N)``. Clients
        reconnect by themselves (gRPC channels do).

        Raises:
            RestartBudgetExhausted: a service crashed more than ``policy.max_restarts`` times
                within ``policy.window`` seconds; every service has been stopped.
        """
        policy = policy or RestartPolicy()
        stop = stop or threading.Event()
        recent: dict[str, list[float]] = {s.name: [] for s in self.services}
        while not stop.is_set() and not self._stopping:
            dead = self.poll()
            if dead is None:
                stop.wait(poll_interval)
                continue
            code = self.returncode(dead)
            now = time.monotonic()
            times = [t for t in recent[dead] if now - t < policy.window]
            if len(times) >= policy.max_restarts:
                self.stop()
                raise RestartBudgetExhausted(dead, code, len(times), policy.window)
            times.append(now)
            recent[dead] = times
            self.restarts[dead] = n = self.restarts.get(dead, 0) + 1
            self._say(f"service {dead!r} exited with code {code}; restarting (restart {n})")
            if stop.wait(policy.delay(len(times))) or self._stopping:
                return
            if self.restart(dead) is None:
                return
            if on_restart is not None:
                on_restart(next(s for s in self.services if s.name == dead), n)

    @staticmethod
    def _say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def _pump(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            if self.forward_output and not line.startswith("READY "):
                sys.stderr.write(line)
                sys.stderr.flush()
        proc.stdout.close()

    def poll(self) -> str | None:
        """Name of the first service whose process has exited, or None while all run."""
        for svc in self.services:
            proc = self.procs.get(svc.name)
            if proc is not None and proc.poll() is not None:
                return svc.name
        return None

    def returncode(self, name: str) -> int | None:
        """Exit status of service ``name`` (None while it runs; negative: killed by that signal)."""
        return self.procs[name].poll()

    def wait_healthy(self, timeout: float = 600.0, on_ready: Callable[[Service], None] | None = None) -> None:
        """Wait until every service reports SERVING through the gRPC health service.

        Services are checked in start order; ``on_ready(service)`` is called as each one becomes
        healthy.

        Raises:
            ServiceExited: a service process exited meanwhile.
            TimeoutError: not all healthy within ``timeout`` seconds.
        """
        from dflash_grpc.serving import wait_healthy  # imports torch: keep it off the CLI's import path

        deadline = time.monotonic() + timeout
        for svc in self.services:
            while True:
                dead = self.poll()
                if dead is not None:
                    raise ServiceExited(dead, self.returncode(dead))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"service {svc.name!r} at {svc.address} not healthy after {timeout:.0f} s")
                try:
                    wait_healthy(svc.address, timeout=min(1.0, left))
                    break
                except TimeoutError:
                    continue
            if on_ready is not None:
                on_ready(svc)

    def stop(self, grace: float | None = None) -> dict[str, int | None]:
        """Stop every service, last started first and one at a time: SIGTERM, wait for it to
        exit, SIGKILL after ``grace`` seconds; then the next one. So the orchestrator (started
        last) drains first (its requests finish or end, and it releases its sessions on the
        target and the drafter) while those are still up, and they stop after it.

        Signals go to each child's process group, so helper processes it started go too.
        Idempotent. Returns the exit status of each service.
        """
        grace = self.grace if grace is None else grace
        with self._lock:
            self._stopping = True
        for _, proc in reversed(list(self.procs.items())):
            if proc.poll() is not None:
                continue
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=max(0.0, grace))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for t in self._readers:
            t.join(timeout=2.0)
        return {name: proc.returncode for name, proc in self.procs.items()}

    def __enter__(self) -> ServiceGroup:
        try:
            self.start()
        except BaseException:
            self.stop()  # those started before the failure
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group led by ``proc`` (started with ``start_new_session``)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
