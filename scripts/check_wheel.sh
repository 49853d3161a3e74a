#!/usr/bin/env bash
# Packaging check: build the wheel, install it into a new virtual environment outside the checkout,
# and, from a directory outside the checkout, import every module of every package the wheel ships
# (each must come from the new environment, none from the checkout) and run `dflash-grpc --help`
# (the new environment's console script). Catches modules or data files left out of the wheel and
# code that only works from the source tree.
#
# Fast and offline: the new environment gets no dependencies of its own. A .pth file in its
# site-packages names the site-packages of the project's environment, so torch, grpc, ... resolve
# from there. Lines of a .pth file are added to sys.path without processing that directory's own
# .pth files, so the editable install of the checkout living there is NOT active.
#
# The wheel is built from a copy of the checkout's files (tracked and untracked-but-not-ignored),
# so a stale build/ directory cannot leak into it. With setuptools and wheel importable in the
# project's environment it builds without build isolation (nothing downloaded); otherwise pip
# fetches the build backend (pyproject.toml's build-system) as usual.
#
# Usage: bash scripts/check_wheel.sh     (PYTHON=... picks the interpreter; default .venv's)
# Exit status: 0 ok, 1 a check failed, 3 the (isolated) wheel build itself failed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
WORK="$(mktemp -d "${TMPDIR:-/tmp}/dflash-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS

# 1. The wheel, built from a copy of the sources.
mkdir "$WORK/src" "$WORK/dist"
if git -C "$ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
     [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) | tar -xf - -C "$WORK/src"
else
  (cd "$ROOT" && tar --exclude=.venv --exclude=build --exclude=dist --exclude='*.egg-info' -cf - .) | tar -xf - -C "$WORK/src"
fi
ISOLATION=()
if "$PYTHON" -c "import setuptools, wheel, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 69)" 2>/dev/null; then
  ISOLATION=(--no-build-isolation)
fi
if ! "$PYTHON" -m pip wheel -q --no-deps "${ISOLATION[@]}" "$WORK/src" -w "$WORK/dist"; then
  # exit status 3: an isolated build could not get its backend (offline?); tests/test_packaging.py skips
  if [ ${#ISOLATION[@]} -eq 0 ]; then echo "check_wheel: the isolated wheel build failed" >&2; exit 3; fi
  exit 1
fi
WHEEL="$(ls "$WORK"/dist/*.whl)"
echo "check_wheel: built $(basename "$WHEEL")"

# 2. A new environment outside the checkout; its dependencies come from the project's environment.
"$PYTHON" -m venv --without-pip "$WORK/venv"
VPY="$WORK/venv/bin/python"
DEPS="$("$PYTHON" -c "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])" | sort -u)"
VSITE="$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
printf '%s\n' "$DEPS" > "$VSITE/_dflash_deps.pth"
env -u PYTHONPATH "$PYTHON" -m pip --python "$VPY" install -q --no-deps "$WHEEL"   # (a PYTHONPATH naming the checkout would make pip see it installed)

# 3. From outside the checkout, with nothing of it on the path.
cd "$WORK"
env -u PYTHONPATH -u PYTHONHOME -u PYTHONSTARTUP "$VPY" - "$ROOT" "$WORK/venv" <<'EOF'
import importlib
import importlib.metadata
import os
import sys

root, venv = (os.path.realpath(p) for p in sys.argv[1:3])
dist = importlib.metadata.distribution("dflash-grpc")
assert os.path.realpath(str(dist.locate_file(""))).startswith(venv + os.sep), dist.locate_file("")
modules = sorted({
    ".".join(f.parts[:-1] + ((f.stem,) if f.stem != "__init__" else ()))
    for f in dist.files if f.suffix == ".py" and not f.parts[0].endswith((".dist-info", ".data"))
})
packages = sorted({m.split(".")[0] for m in modules})
bad = []
for name in modules:
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - report them all
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
        continue
    where = os.path.realpath(getattr(mod, "__file__", "") or "")
    if not where.startswith(venv + os.sep) or where.startswith(root + os.sep):
        bad.append(f"{name}: imported from {where}, not from the new environment")
shipped = {str(f) for f in dist.files}
for pattern in ("dflash_grpc/v1/", ".proto"), ("draft_service/data/", ".gguf"):  # package data
    if not any(f.startswith(pattern[0]) and f.endswith(pattern[1]) for f in shipped):
        bad.append(f"no {pattern[0]}*{pattern[1]} in the wheel")
if bad:
    sys.exit("check_wheel: modules that failed:\n  " + "\n  ".join(bad))
print(f"check_wheel: {len(modules)} modules of {len(packages)} packages ({', '.join(packages)}) import from the wheel")
EOF
env -u PYTHONPATH "$WORK/venv/bin/dflash-grpc" --help > "$WORK/help.txt"
grep -q "usage: dflash-grpc" "$WORK/help.txt" || { echo "check_wheel: unexpected 'dflash-grpc --help' output:" >&2; cat "$WORK/help.txt" >&2; exit 1; }
echo "check_wheel: dflash-grpc --help runs; OK in $((SECONDS - t0)) s"
