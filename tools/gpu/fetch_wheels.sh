#!/usr/bin/env bash
# Wheels of what shardspeed needs and the lent GPU machine's image lacks (it has torch 2.11,
# transformers, accelerate, httpx, numpy, safetensors, tqdm, psutil, ninja, pytest, but no
# pydantic, starlette, uvicorn or openai), for its Python 3.12, into .whl/ (git-ignored).
# Run here, in the repository root, before a device session; tools/gpu/session.sh installs
# them there. About 6 MB, well inside the 64 MiB a device call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
mkdir -p .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  starlette==1.10.0 uvicorn==0.54.0 openai==3.57.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1
ls .whl
