#!/usr/bin/env bash
# The wheels `bash tools/gpu_run.sh http` (tools/gpu_http.sh) installs on the GPU machine, which has no
# registry: the HTTP front door's stack (FastAPI, Starlette, pydantic, uvicorn) and aiperf 0.13 with
# those of its dependencies that `aiperf profile` imports and the machine's image lacks
# (/work/.library/device/KINDS.md, "Python packages already there"). Run here, in the repo root,
# where pip reaches PyPI:
#
#   bash tools/http_wheels.sh            # -> .whl-http/ (ignored; about 15 MiB, CPython 3.12, x86-64)
#
# aiperf 0.13 declares about 50 dependencies (dash, plotly, optuna, kopf, kubernetes-asyncio,
# datasets, soundfile, ... for its plots, Kubernetes and dataset modes: 50 MiB of wheels missing
# from the image, more than a device call carries). `aiperf profile` against an OpenAI endpoint
# imports none of them: this list is what a real `aiperf profile --endpoint-type completions
# --streaming --input-file ... --ui-type none` run needed in a Python 3.12 environment holding only
# the image's packages (found by running it and adding each missing module). A newer aiperf may
# import more: pin it.
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="aiperf==0.13.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
pydantic-settings==2.16.3 python-dotenv==1.2.4 cyclopts==4.25.3 docstring-parser==0.18.0 rich-rst==2.2.0
msgspec==0.22.0 orjson==3.11.9 pyzmq==26.4.0 ruamel-yaml==0.18.17 ruamel-yaml-clib==0.2.15 setproctitle==1.3.8
jmespath==1.0.1 crick==0.0.8 ffmpeg-python==0.2.0 future==1.0.0
fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34 opentelemetry-api==1.45.2"
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 \
         manylinux_2_5_x86_64; do plats+=(--platform "$p"); done
mkdir -p .whl-http
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}" \
  -d .whl-http $PKGS
ls .whl-http | wc -l
du -sh .whl-http
