"""Server CPU per streamed message: gRPC's thread-per-stream server against its asyncio server (issue 23).

    python tools/grpc_stream_cost.py [--streams 64] [--messages 400] [--tick-ms 1] [--every 1]
                                     [--servers sync,aio] [--repeats 3] [--json FILE]

The orchestrator streams every request's tokens from a handler thread of grpc's synchronous
server (``grpc.server``): the scheduler thread hands a request's events to its thread through a
``queue.Queue`` and the thread yields one ``GenerateResponse`` per batch of events, which
``_send_response`` sends and waits for. At 64 streams that path is most of the orchestrator's
host time per item on the CPU box (``tools/host_per_item.py --threads``: the handler threads about
25 us per item, about 200 us per message sent). This tool measures that path alone, and the
alternative of gRPC's asyncio server, with nothing else in the process:

* one server process (``--servers``: ``sync``, the thread-per-stream server as
  ``dflash_grpc.serving.make_server`` builds it, its pool holding every stream; ``aio``, one event
  loop thread), one unary-stream method that streams a real ``GenerateResponse`` (a few token ids
  and their text) per event;
* a producer thread in it standing for the scheduler: every ``--tick-ms`` it hands an event to
  every ``--every``-th stream's queue, the sync server's ``queue.Queue`` (one ``put`` per stream)
  or, for ``aio``, one ``loop.call_soon_threadsafe`` per tick that puts into every stream's
  ``asyncio.Queue``: one cross-thread hand-over per tick, not per stream;
* the clients in another process (``grpc.aio``, one event loop), so their CPU is not counted.

Reported per server: the server process's CPU seconds (``time.process_time``: every thread,
gRPC's own included) over the steady window (from the moment every stream is open to the producer's
last event) divided by the messages the handlers yielded in it (``us/message``) and by the events
handed to them (``us/event``: below ``us/message`` where a stream fell behind and sent several
events as one message), in microseconds; the events per second; and the wall time. Each server runs ``--repeats`` times, alternating. Figures are of this machine (a
bound, not the GPU host's), compare within a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time

sys.path[:0] = [".", "proto"]

METHOD = "/dflash.bench.StreamCost/Stream"
TOKENS = [9906, 11, 1917, 0]   # a few token ids per message, as a tick of a few accepted tokens sends


def _payload() -> bytes:
    from dflash_grpc.v1 import generation_pb2

    return generation_pb2.GenerateResponse(text=" the answer", token_ids=TOKENS).SerializeToString()


# ------------------------------------------------------------------------------------------ server

def _producer(streams: int, messages: int, tick_s: float, every: int, put_tick, ready: threading.Event,
              marks: dict, yielded: list) -> None:
    """The scheduler's stand-in: once every stream is open, ``messages`` ticks; each hands one
    event to every ``every``-th stream (rotating), then a final ``None`` to every stream.
    ``yielded``: the servers' count of messages sent (``[n]``), read at both ends of the window.
    If the streams do not all open within a minute (a client died), ``marks["error"]`` says so
    and no tick runs."""
    if not ready.wait(60):
        marks["error"] = "the clients did not open every stream within 60 s"
        return
    marks["t0"], marks["cpu0"], marks["y0"] = time.monotonic(), time.process_time(), yielded[0]
    sent = 0
    for tick in range(messages * every):
        targets = [s for s in range(streams) if (s + tick) % every == 0]
        put_tick(targets, tick)
        sent += len(targets)
        time.sleep(tick_s)
    marks["t1"], marks["cpu1"], marks["sent"], marks["y1"] = time.monotonic(), time.process_time(), sent, yielded[0]
    put_tick(list(range(streams)), None)


def _serve_sync(port_q, args) -> None:
    import grpc

    from dflash_grpc import serving

    payload = _payload()
    queues: dict[int, queue.Queue] = {}
    opened = threading.Event()
    lock = threading.Lock()
    marks: dict = {}
    yielded = [0]   # (the handler threads count under count_lock)
    count_lock = threading.Lock()

    def count():
        with count_lock:
            yielded[0] += 1

    def stream(request, context):
        sid = int.from_bytes(request, "little")
        q = queue.Queue()
        with lock:
            queues[sid] = q
            if len(queues) == args.streams:
                opened.set()
        while True:
            ev = q.get()
            if ev is None:
                return
            try:   # the events queued behind it go out in the same message (the orchestrator's rule)
                while True:
                    if q.get_nowait() is None:
                        count()
                        yield payload
                        return
            except queue.Empty:
                pass
            count()
            yield payload

    def put_tick(targets, ev):
        for s in targets:
            queues[s].put(ev)

    handler = grpc.method_handlers_generic_handler("dflash.bench.StreamCost", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    def add(s):
        s.add_generic_rpc_handlers((handler,))
        return ["dflash.bench.StreamCost"]

    server, _health, port = serving.make_server(add, "127.0.0.1:0", max_workers=args.streams + 4)
    t = threading.Thread(target=_producer, args=(args.streams, args.messages, args.tick_ms / 1000, args.every, put_tick,
                                                 opened, marks, yielded), daemon=True)
    t.start()
    port_q.put(port)
    t.join()
    time.sleep(0.5)
    port_q.put(marks)
    server.stop(1).wait()


def _serve_aio(port_q, args) -> None:
    import grpc

    payload = _payload()
    marks: dict = {}
    yielded = [0]

    async def main():
        loop = asyncio.get_running_loop()
        queues: dict[int, asyncio.Queue] = {}
        opened = threading.Event()

        async def stream(request, context):
            sid = int.from_bytes(request, "little")
            q = asyncio.Queue()
            queues[sid] = q
            if len(queues) == args.streams:
                opened.set()
            while True:
                ev = await q.get()
                if ev is None:
                    return
                while not q.empty():   # the events queued behind it go out in the same message
                    if q.get_nowait() is None:
                        yielded[0] += 1
                        yield payload
                        return
                yielded[0] += 1
                yield payload

        def deliver(targets, ev):
            for s in targets:
                queues[s].put_nowait(ev)

        def put_tick(targets, ev):   # one hand-over to the loop per tick, every stream's event in it
            loop.call_soon_threadsafe(deliver, targets, ev)

        handler = grpc.method_handlers_generic_handler("dflash.bench.StreamCost", {
            "Stream": grpc.unary_stream_rpc_method_handler(stream)})
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        t = threading.Thread(target=_producer, args=(args.streams, args.messages, args.tick_ms / 1000, args.every,
                                                     put_tick, opened, marks, yielded), daemon=True)
        t.start()
        port_q.put(port)
        await loop.run_in_executor(None, t.join)
        await asyncio.sleep(0.5)
        port_q.put(marks)
        await server.stop(1)

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ client

def _clients(port: int, streams: int, out_q) -> None:
    import grpc

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_stream(METHOD)

            async def one(sid):
                n = 0
                async for _ in call(sid.to_bytes(4, "little")):
                    n += 1
                return n

            got = await asyncio.gather(*(one(s) for s in range(streams)))
        out_q.put(sum(got))

    asyncio.run(main())


def run_one(kind: str, args) -> dict:
    """One server of ``kind`` (``sync`` / ``aio``) with ``args.streams`` clients; its figures.

    Raises:
        RuntimeError: the server or the clients failed or stalled (both processes are stopped:
            they are daemons, terminated on the way out)."""
    ctx = mp.get_context("spawn")
    port_q, out_q = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_serve_sync if kind == "sync" else _serve_aio, args=(port_q, args), daemon=True)
    client = None
    limit = 120 + 2 * args.messages * args.every * args.tick_ms / 1000   # the ticks' own time, twice, and two minutes
    try:
        server.start()
        port = port_q.get(timeout=60)
        client = ctx.Process(target=_clients, args=(port, args.streams, out_q), daemon=True)
        client.start()
        marks = port_q.get(timeout=limit)
        if "error" in marks:
            raise RuntimeError(f"{kind}: {marks['error']}")
        received = out_q.get(timeout=120)
        client.join(30)
        server.join(30)
    except queue.Empty:
        raise RuntimeError(f"{kind}: the server or its clients stalled (no figures within {limit:.0f} s)") from None
    finally:
        for proc in (client, server):
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(10)
    wall = marks["t1"] - marks["t0"]
    cpu = marks["cpu1"] - marks["cpu0"]
    msgs = marks["y1"] - marks["y0"]
    return {"server": kind, "streams": args.streams, "events": marks["sent"], "messages": msgs,
            "messages_received": received, "wall_s": wall, "cpu_s": cpu,
            "us_per_event": 1e6 * cpu / max(marks["sent"], 1), "us_per_message": 1e6 * cpu / max(msgs, 1),
            "events_per_s": marks["sent"] / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--messages", type=int, default=400, help="events per stream")
    p.add_argument("--tick-ms", type=float, default=1.0, help="the producer's sleep between ticks")
    p.add_argument("--every", type=int, default=1, help="a tick reaches every EVERY-th stream (rotating)")
    p.add_argument("--servers", default="sync,aio")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = []
    kinds = [k.strip() for k in a.servers.split(",") if k.strip()]
    print(f"# grpc_stream_cost: {a.streams} streams, {a.messages} events each, tick {a.tick_ms} ms, every {a.every}; "
          f"{os.cpu_count()} CPUs; server CPU us per event (events coalesce into fewer messages when a stream falls behind)")
    for rep in range(a.repeats):
        for kind in kinds:
            r = run_one(kind, a)
            r["repeat"] = rep
            rows.append(r)
            print(f"{kind:5s} rep {rep}: {r['us_per_message']:7.1f} us/message, {r['us_per_event']:7.1f} us/event, "
                  f"{r['events_per_s']:9.0f} events/s, {r['messages']} messages for {r['events']} events in the window, "
                  f"wall {r['wall_s']:.2f} s", flush=True)
    for kind in kinds:
        us = [r["us_per_message"] for r in rows if r["server"] == kind]
        print(f"{kind:5s}: median {statistics.median(us):.1f} us/message [{min(us):.1f}, {max(us):.1f}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
