"""Service configs as command lines: one frozen dataclass per service holds every setting with its
default (once) and its help text; the service's flags are built from it and read back into it.

A field is declared with :func:`setting`::

    @dataclasses.dataclass(frozen=True)
    class FooConfig:
        port: int = setting(50051, "port to listen on (0: a free one)")
        cuda_graphs: bool = setting(True, "run the steps through CUDA graphs", flag="--no-cuda-graphs")

Each field becomes the flag ``--<name with dashes>`` (``dest`` = the field name), its type read
from the annotation (``int``, ``float``, ``str``, ``tuple[int, ...]`` as ``1,2,4``, each optionally
``| None``); a ``bool`` field that defaults to True becomes a ``--no-<name>`` switch, one that
defaults to False a ``--<name>`` switch. A field without a default is a required flag.

:func:`add_flags` adds a config's flags to a parser, :func:`from_args` reads the parsed namespace
back into the config, :func:`flag_table` lists flag, default and help (what ``docs/CONFIG.md``
shows). Imports no torch: the orchestrator stands on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, NamedTuple

#: gRPC worker threads a service keeps beyond one per open stream when ``--max-workers`` is unset
STREAM_HEADROOM = 16


def batch_buckets_for(max_sessions: int) -> tuple[int, ...]:
    """The batch buckets of a batched engine of ``max_sessions`` session slots when none are
    configured (docs/ARCHITECTURE.md, "The GPU path"): the powers of two below ``max_sessions``,
    then ``max_sessions`` itself, so that a step of every session the pool holds runs in one
    bucket: ``(1, 2, 4, ..., 64)`` for 64 slots, ``(..., 64, 128, 256)`` for 256, ``(..., 64, 128,
    130)`` for 130. A step of ``n`` rows (sessions) runs in the smallest bucket that holds it.

    Raises:
        ValueError: ``max_sessions < 1``.
    """
    n = int(max_sessions)
    if n < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    return tuple(1 << i for i in range(n.bit_length()) if 1 << i < n) + (n,)


#: The batch buckets of an engine of 64 session slots (the GPU target's default): what
#: :func:`batch_buckets_for` gives for 64. Defined here, torch-free; :mod:`runtime.graphs`
#: re-exports it.
BATCH_BUCKETS = batch_buckets_for(64)


def setting(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None,
            choices: tuple[str, ...] | None = None, metavar: str | None = None) -> Any:
    """A config field: its ``default`` (omitted: a required flag), its ``help`` text, and how its
    flag reads (``flag``: the option string, default ``--<name>``; ``choices``; ``metavar``)."""
    meta = {"help": help, "flag": flag, "choices": choices, "metavar": metavar}
    return dataclasses.field(default=default, metadata=meta)


def session_lifetime_settings() -> tuple[Any, Any, Any]:
    """The three session-lifetime fields the target and the draft service share, as
    ``session_idle_timeout, lease_s, shutdown_timeout = session_lifetime_settings()`` inside a
    config dataclass (seconds each; docs/ARCHITECTURE.md, "Owners, leases and shutdown")."""
    return (
        setting(300.0, "release a session unused for this long (its Release was lost); 0 = never", metavar="SECONDS"),
        setting(5.0, "release every session of an owner (an orchestrator: its dflash-owner metadata) that has no "
                "call in flight, an open stream included, for this long; 0 = never", metavar="SECONDS"),
        setting(30.0, "on SIGTERM: refuse new work, wait this long at most for clients to release their sessions "
                "(or close their streams), then end the streams left and exit", metavar="SECONDS"),
    )


def ints(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)`` (empty items skipped)."""
    return tuple(int(x) for x in text.split(",") if x.strip())


class Flag(NamedTuple):
    """One config field as a command-line flag."""

    option: str               #: ``--max-sessions``
    field: str                #: ``max_sessions``
    kind: type                #: int, float, str, bool or tuple (of ints)
    default: Any              #: the field's default (``dataclasses.MISSING``: required)
    help: str
    choices: tuple[str, ...] | None
    metavar: str | None

    @property
    def required(self) -> bool:
        """True when the field has no default (the flag must be given)."""
        return self.default is dataclasses.MISSING


def _kind(annotation: Any) -> type:
    """The value type of a field annotation: ``int | None`` -> int, ``tuple[int, ...]`` -> tuple."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _kind(inner)
    if typing.get_origin(annotation) is tuple or annotation is tuple:
        return tuple
    if annotation in (int, float, str, bool):
        return annotation
    raise TypeError(f"config fields must be int, float, str, bool or tuple[int, ...] (optionally | None), got {annotation!r}")


def flags(cls: type) -> list[Flag]:
    """The flags of config dataclass ``cls``, in field order."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = _kind(hints[f.name])
        default = f.default
        option = f.metadata.get("flag")
        if option is None:
            dashed = f.name.replace("_", "-")
            option = f"--no-{dashed}" if kind is bool and default is True else f"--{dashed}"
        out.append(Flag(option, f.name, kind, default, f.metadata.get("help", ""), f.metadata.get("choices"),
                        f.metadata.get("metavar")))
    return out


def show_default(value: Any) -> str:
    """How a default reads in ``--help`` and the docs: ``1,2,4`` for a tuple, ``none`` for ``()``
    and ``None``, ``on``/``off`` for a switch, else ``str(value)``."""
    if value is dataclasses.MISSING:
        return "required"
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """Add one flag per field of config dataclass ``cls`` to ``parser`` (or an argument group);
    each help text ends with the field's default. Read them back with :func:`from_args`."""
    for fl in flags(cls):
        text = fl.help.replace("%", "%%")
        if fl.kind is bool:
            parser.add_argument(fl.option, dest=fl.field, action="store_false" if fl.default else "store_true",
                                help=f"{text} (default: on; {fl.option} turns it off)" if fl.default else f"{text} (default: off)")
            continue
        kw: dict[str, Any] = {"dest": fl.field, "help": text}
        if fl.required:
            kw["required"] = True
        else:
            kw["default"] = fl.default
            if fl.default is not None:
                kw["help"] = f"{text} (default: {show_default(fl.default)})"
        parse: Callable[[str], Any] = ints if fl.kind is tuple else fl.kind
        kw["type"] = parse
        if fl.choices:
            kw["choices"] = list(fl.choices)
        if fl.metavar:
            kw["metavar"] = fl.metavar
        parser.add_argument(fl.option, **kw)


def from_args(cls: type, args: argparse.Namespace):
    """The config ``cls`` that parsed flags (:func:`add_flags`) describe."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def flag_table(cls: type) -> list[tuple[str, str, str]]:
    """``(flag, default, help)`` per field of ``cls``: what ``docs/CONFIG.md`` lists."""
    return [(fl.option, show_default(fl.default), fl.help) for fl in flags(cls)]


def worker_threads(configured: int | None, streams: int) -> int:
    """gRPC worker threads of a service: ``--max-workers`` if set, else one per possible open
    stream plus :data:`STREAM_HEADROOM` (the server keeps 8 more for unary calls)."""
    return configured or streams + STREAM_HEADROOM
