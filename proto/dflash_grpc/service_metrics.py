"""Prometheus metrics of the target and draft services (``--metrics-port``), read at scrape time.

:class:`StepLoopCollector` is a custom ``prometheus_client`` collector: it reads the counters a
:class:`runtime.step_loop.StepLoop` already keeps (``ticks``, ``items``, ``busy_s``,
``prefill_tokens``) and its engine's session pool when Prometheus scrapes, so the step loop's hot
path does nothing extra. Series (label ``service``: ``target`` or ``draft``)::

    dflash_engine_ticks_total            batched steps run
    dflash_engine_items_total            items (sessions' trees) in those steps
    dflash_engine_busy_seconds_total     seconds spent in batched steps
    dflash_engine_prefill_tokens_total   prompt tokens prefilled
    dflash_engine_mean_batch             items / ticks since start
    dflash_engine_pool_slots             session slots (capacity)
    dflash_engine_pool_free_slots        slots not held by a session
    dflash_engine_pool_bytes             bytes of the state pool (batched engines only)
    dflash_engine_reaped_sessions_total  sessions released for being idle (loops that reap)

Step time is ``rate(busy_seconds_total) / rate(ticks_total)``; batch size
``rate(items_total) / rate(ticks_total)``; utilisation ``rate(busy_seconds_total)``.

This module imports no torch: it only reads attributes.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry


def pool_usage(engine: Any) -> tuple[int, int, int | None]:
    """``(slots, free, pool_bytes)`` of an engine's session pool.

    Batched engines (``BatchedEngine``, ``BatchedDrafter``) have ``pool`` (a
    ``runtime.pool.StatePool``: ``slots``, ``free``, ``nbytes``); the reference engines
    (``TargetEngine``, ``ReferenceDrafterEngine``) have ``max_sessions`` and a ``sessions`` dict
    (``pool_bytes`` is then ``None``).
    """
    pool = getattr(engine, "pool", None)
    if pool is not None and hasattr(pool, "free"):
        slots = int(getattr(pool, "slots", getattr(engine, "max_sessions", 0)))
        try:
            nbytes = int(pool.nbytes)
        except Exception:  # noqa: BLE001 - a pool without tensors (a fake) has no size
            nbytes = None
        return slots, int(pool.free), nbytes
    slots = int(getattr(engine, "max_sessions", 0))
    return slots, max(0, slots - len(getattr(engine, "sessions", ()))), None


class StepLoopCollector(Collector):
    """Expose a step loop's counters and its engine's pool use.

    Args:
        loop: a ``StepLoop`` (anything with ``ticks``, ``items``, ``busy_s``, ``prefill_tokens``
            and ``engine``).
        service: value of the ``service`` label (``target`` or ``draft``).
    """

    def __init__(self, loop: Any, service: str):
        self.loop = loop
        self.service = service

    def describe(self) -> list:
        return []  # no duplicate check at registration: names are fixed, the label tells services apart

    def collect(self) -> Iterator:
        loop, labels = self.loop, [self.service]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=["service"])
            m.add_metric(labels, value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(name, doc, labels=["service"])
            m.add_metric(labels, value)
            return m

        ticks, items = int(loop.ticks), int(loop.items)
        yield counter("dflash_engine_ticks", "Batched steps run by the step loop", ticks)
        yield counter("dflash_engine_items", "Items (one session's tree each) run in batched steps", items)
        yield counter("dflash_engine_busy_seconds", "Seconds the step loop spent in batched steps", float(loop.busy_s))
        yield counter("dflash_engine_prefill_tokens", "Prompt tokens prefilled", int(getattr(loop, "prefill_tokens", 0)))
        yield gauge("dflash_engine_mean_batch", "Items per batched step, mean since start", items / ticks if ticks else 0.0)
        reaped = getattr(loop, "reaped", None)
        if reaped is not None:
            yield counter("dflash_engine_reaped_sessions", "Sessions released for being idle", int(reaped))
        slots, free, nbytes = pool_usage(loop.engine)
        yield gauge("dflash_engine_pool_slots", "Session slots of the engine", slots)
        yield gauge("dflash_engine_pool_free_slots", "Session slots not held by a session", free)
        if nbytes is not None:
            yield gauge("dflash_engine_pool_bytes", "Bytes of the engine's state pool", nbytes)


def serve_metrics(port: int, host: str, loop: Any, service: str,
                  registry: CollectorRegistry = REGISTRY) -> StepLoopCollector:
    """Register a :class:`StepLoopCollector` for ``loop`` and serve ``registry`` over HTTP on
    ``host:port`` (``prometheus_client.start_http_server``, a daemon thread); returns the collector."""
    from prometheus_client import start_http_server

    collector = StepLoopCollector(loop, service)
    registry.register(collector)
    start_http_server(port, addr=host, registry=registry)
    return collector


__all__ = ["StepLoopCollector", "pool_usage", "serve_metrics"]
