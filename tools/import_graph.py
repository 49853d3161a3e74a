"""The project's import graph, read from the source (every ``import`` statement, lazy ones
included): which package stands on which, the arrows that break the layering of
docs/ARCHITECTURE.md ("Packages"), and import cycles between modules.

    python tools/import_graph.py            # summary; exit status 1 on a violation or a cycle

tests/test_layering.py runs the same checks.
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: package -> its source folder (relative to the root)
PACKAGES = {
    "dflash_grpc": "proto/dflash_grpc", "kernels": "kernels", "runtime": "runtime",
    "target_service": "target_service", "draft_service": "draft_service", "orchestrator": "orchestrator",
    "client": "client", "training": "training", "bench": "bench", "fixtures": "fixtures",
}

#: what each package may import (besides itself): the floors below it, never a sibling or above
ALLOWED = {
    "dflash_grpc": set(),
    "kernels": set(),
    "runtime": {"dflash_grpc", "kernels"},
    "target_service": {"dflash_grpc", "kernels", "runtime"},
    "draft_service": {"dflash_grpc", "kernels", "runtime"},
    "orchestrator": {"dflash_grpc", "runtime"},
    "client": {"dflash_grpc"},
    "fixtures": {"dflash_grpc", "kernels", "runtime"},
    "training": {"dflash_grpc", "kernels", "runtime", "target_service", "draft_service", "fixtures"},
    "bench": {"dflash_grpc", "kernels", "runtime", "target_service", "draft_service", "client", "fixtures"},
}

#: entry points that start or drive everything (the ``dflash-grpc`` command; ``python -m
#: orchestrator``, which builds the target in its own process for ``--target in-process``): they may
#: import any package, lazily, inside the command that needs it (tests/test_layering.py checks the
#: orchestrator still starts without torch)
ENTRY_POINTS = {"client.cli", "client.launcher", "orchestrator.__main__"}

#: modules of the runtime the orchestrator may stand on: those that import no torch
TORCH_FREE = {"runtime", "runtime.errors", "runtime.sampling", "runtime.defaults", "runtime.gguf_loader",
              "runtime.tokenizer", "runtime.fingerprint", "runtime.config", "runtime.tree", "runtime.owners"}


def modules() -> dict[str, str]:
    """Dotted module name -> file path, for every module of :data:`PACKAGES`."""
    out = {}
    for pkg, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), base)[:-3].replace(os.sep, ".")
                name = pkg if rel == "__init__" else f"{pkg}.{rel.removesuffix('.__init__')}"
                out[name] = os.path.join(dirpath, f)
    return out


def imports(path: str, name: str, known: set[str]) -> set[str]:
    """Project modules imported by one file (absolute and relative imports, lazy ones included)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                parts = parts if is_pkg else parts[:-1]
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports(p, m, known) for m, p in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    """Arrows that break the layering (:data:`ALLOWED`) or pull torch into the orchestrator."""
    bad = []
    for m, deps in sorted(g.items()):
        pkg = m.split(".")[0]
        if m in ENTRY_POINTS:
            continue
        for d in sorted(deps):
            dpkg = d.split(".")[0]
            if dpkg != pkg and dpkg not in ALLOWED[pkg]:
                bad.append(f"{m} -> {d}")
            if pkg == "orchestrator" and dpkg == "runtime" and d not in TORCH_FREE:
                bad.append(f"{m} -> {d} (imports torch)")
    return bad


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), excluding a package and its
    own submodules importing each other through the package's ``__init__`` (re-exports)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def edges(v):
        # an __init__ re-exporting from its submodules is not a cycle with them
        return [w for w in g.get(v, ()) if not (w.startswith(v + ".") or v.startswith(w + "."))]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            strong(v)
    return out


def main() -> int:
    g = graph()
    per_pkg = defaultdict(set)
    for m, deps in g.items():
        for d in deps:
            if d.split(".")[0] != m.split(".")[0]:
                per_pkg[m.split(".")[0]].add(d.split(".")[0])
    for pkg in PACKAGES:
        print(f"{pkg:15s} -> {', '.join(sorted(per_pkg[pkg])) or '-'}")
    bad, cyc = violations(g), cycles(g)
    for b in bad:
        print("layering:", b)
    for c in cyc:
        print("cycle:", " <-> ".join(c))
    return 1 if bad or cyc else 0


if __name__ == "__main__":
    sys.exit(main())
