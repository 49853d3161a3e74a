"""Evaluate every panel query of the Grafana dashboard (docs/grafana/dflash.json) in a real
Prometheus scraping the three services under load; each query must return data.

    python tools/prometheus_check.py                      # start the services (tiny CPU models), load them, check
    python tools/prometheus_check.py --model M.gguf --drafter D.gguf   # the same with given models
    python tools/prometheus_check.py --scrape host:port --scrape host:port ...   # services already running (and loaded)

It runs the ``prometheus`` binary (``--prometheus PATH``, else the one on PATH: Debian's
``prometheus`` package) with a 1 s scrape interval and a temporary database. Without
``--scrape`` it starts target, draft and orchestrator (``client.launcher.dflash_services``, each with
``--metrics-port``, the orchestrator with ``--http-port``) on synthetic tiny models
(``fixtures.tiny_models``) unless ``--model`` is given, and sends completions over HTTP for
``--seconds`` while Prometheus scrapes. Then every query is sent to Prometheus's HTTP API
(``/api/v1/query``); a query that fails or returns no series is reported and the exit status is 1.

Without a Prometheus binary it prints why and exits 0 (a clean skip). ``tests/test_http.py``
checks, without Prometheus, that every metric name the queries use is exported by a live
``/metrics``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "proto")]


def panel_queries(path: str) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every query of the dashboard at ``path`` (Grafana's
    ``$__rate_interval`` / ``$__interval`` become 1m)."""
    with open(path, encoding="utf-8") as f:
        board = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", ""), t["expr"].replace("$__rate_interval", "1m").replace("$__interval", "1m")))
            walk(p.get("panels", []))

    walk(board["panels"])
    return out


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def run_prometheus(binary: str, targets: list[str], workdir: str, port: int) -> subprocess.Popen:
    """Start Prometheus scraping ``targets`` (host:port of /metrics) every second; wait until ready."""
    config = os.path.join(workdir, "prometheus.yml")
    with open(config, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                f"  - job_name: dflash\n    static_configs:\n      - targets: {json.dumps(targets)}\n")
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            _get(f"http://127.0.0.1:{port}/-/ready", 1.0)
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"prometheus did not start: {proc.stderr.read().decode(errors='replace')[-2000:]}")
            time.sleep(0.2)


def load(http_base: str, seconds: float, model: str, streams: int = 2) -> None:
    """Send short completions to the HTTP front door from ``streams`` threads for ``seconds``."""
    stop = time.monotonic() + seconds
    prompts = ["The quick brown fox", "def add(a, b):", "Once upon a time", "Hello, world!"]

    def worker(i: int) -> None:
        n = 0
        while time.monotonic() < stop:
            body = json.dumps({"model": model, "prompt": prompts[(i + n) % len(prompts)], "max_tokens": 24,
                               "temperature": 0, "ignore_eos": True}).encode()
            req = urllib.request.Request(f"{http_base}/v1/completions", body, {"Content-Type": "application/json"})
            try:
                _get_req(req)
            except OSError as e:
                print(f"load request failed: {e}", file=sys.stderr)
            n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _get_req(req: urllib.request.Request) -> bytes:
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def check(prom: str, queries: list[tuple[str, str]]) -> list[str]:
    """Evaluate each query at Prometheus ``prom`` (base URL); the failures, as lines."""
    bad = []
    for title, expr in queries:
        try:
            reply = json.loads(_get(f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"))
        except OSError as e:
            bad.append(f"{title}: {expr}: {e}")
            continue
        result = reply.get("data", {}).get("result", [])
        status = "ok" if reply.get("status") == "success" and result else "NO DATA"
        print(f"{status:8} {len(result):3} series  {title}: {expr}")
        if status != "ok":
            bad.append(f"{title}: {expr}: {reply.get('error') or 'no series'}")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when every query returned data (or no Prometheus binary: skipped), 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default=None, help="the prometheus binary (default: on PATH)")
    p.add_argument("--dashboard", default=os.path.join(ROOT, "docs", "grafana", "dflash.json"))
    p.add_argument("--scrape", action="append", default=[], metavar="HOST:PORT",
                   help="a running service's metrics address (repeat; omit: start the services here)")
    p.add_argument("--model", default=None, help="target GGUF (default: a synthetic tiny llama)")
    p.add_argument("--drafter", default=None, help="drafter GGUF (default: a random drafter for the tiny llama)")
    p.add_argument("--seconds", type=float, default=20.0, help="seconds of load while Prometheus scrapes")
    args = p.parse_args(argv)
    binary = args.prometheus or shutil.which("prometheus")
    if binary is None or not os.path.exists(binary):
        print("prometheus_check: no prometheus binary (apt-get install prometheus, or --prometheus PATH): skipped")
        return 0
    queries = panel_queries(args.dashboard)
    from client.launcher import ServiceGroup, dflash_services, free_ports

    with tempfile.TemporaryDirectory(prefix="dflash-prom-") as tmp:
        group = None
        try:
            scrape = list(args.scrape)
            if not scrape:
                model, drafter = args.model, args.drafter
                if model is None:
                    from draft_service.init_random import write_random_drafter
                    from fixtures.tiny_models import write_tiny_llama

                    model = str(write_tiny_llama(os.path.join(tmp, "target.gguf"), seed=3).path)
                    drafter = os.path.join(tmp, "drafter.gguf")
                    write_random_drafter(model, drafter, block_size=8, num_target_layers=3, std=0.1, dtype="f32", seed=1)
                t, d, o, http, mt, md, mo = free_ports(7)
                group = ServiceGroup(dflash_services(
                    model, drafter, ports=(t, d, o), http_port=http,
                    target_args=["--metrics-port", str(mt), "--max-context", "1024"], draft_args=["--metrics-port", str(md)],
                    orchestrator_args=["--metrics-port", str(mo)]), grace=10.0, forward_output=False)
                group.start()
                group.wait_healthy(timeout=300)
                scrape = [f"127.0.0.1:{port}" for port in (mt, md, mo)]
            prom_port = free_ports(1)[0]
            prom = run_prometheus(binary, scrape, tmp, prom_port)
            try:
                if group is not None:
                    names = json.loads(_get(f"http://127.0.0.1:{http}/v1/models"))["data"]
                    load(f"http://127.0.0.1:{http}", args.seconds, names[0]["id"])
                    time.sleep(3)   # the last scrapes after the load
                else:
                    time.sleep(args.seconds)
                bad = check(f"http://127.0.0.1:{prom_port}", queries)
            finally:
                prom.terminate()
                prom.wait(10)
        finally:
            if group is not None:
                group.stop()
    if bad:
        print(f"{len(bad)} of {len(queries)} queries returned no data:\n  " + "\n  ".join(bad))
        return 1
    print(f"all {len(queries)} dashboard queries returned data")
    return 0


if __name__ == "__main__":
    sys.exit(main())
