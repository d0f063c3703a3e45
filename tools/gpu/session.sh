#!/usr/bin/env bash
# Everything a lent GPU session checks, in one call of the device tool, sized for about
# 9 of its 15 device minutes (docs/benchmarks.md, "GPU session"):
#
#   bash tools/gpu/fetch_wheels.sh                      # here, once (.whl/ is git-ignored)
#   device run: command="bash tools/gpu/session.sh", carry=[".whl"], timeout_s=590
#
# Steps, in priority order, each under its own time limit so one hang cannot spend the
# lease: env (GPU, torch, imports), tests (pytest -m gpu: tests/device, the Triton kernel,
# CUDA offload), train (train_bench --preset 1b, bf16, ZeRO 0 and 3 against DDP / FSDP2,
# MFU), serve (serve_bench --quick, bf16: HF generate against our schedulers), train117m
# (a second model size). STEPS="env tests" runs a subset. Logs and JSON go to $OUT (they
# come back; at most 8 files), with the last lines of each step printed as it ends.
set -u
OUT=${OUT:-/tmp/shardspeed-gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
STEPS=${STEPS:-"env tests train serve train117m"}
cd "$(dirname "$0")/../.."

if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

step() {  # step NAME LIMIT_S CMD...: run CMD into $OUT/NAME.log, report its status and tail
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0))s"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

step env 60 bash -c "nvidia-smi -L; $PY - <<'PY'
import torch, transformers, pydantic
import shardspeed
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device', torch.cuda.get_device_name())
print('transformers', transformers.__version__, 'pydantic', pydantic.__version__)
print('shardspeed', shardspeed.__file__)
PY"
step tests 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider --timeout 150 \
  tests/device tests/unit/test_sparse_attention_triton.py tests/unit/inference/test_fastgen_offload.py
step train 240 "$PY" benchmarks/train_bench.py --device cuda --engines torch,shardspeed \
  --stages 0,3 --preset 1b --steps 8 --warmup 3 --rounds 1 --markdown \
  --json-out "$OUT/train_1b.json" --log-dir /tmp/train_logs --timeout 200
step serve 150 "$PY" benchmarks/serve_bench.py --quick --device cuda --clients 1,4,16
step train117m 100 "$PY" benchmarks/train_bench.py --device cuda --engines torch,shardspeed \
  --stages 0,3 --preset 117m --steps 10 --warmup 3 --rounds 1 --markdown --timeout 60 \
  --log-dir /tmp/train_logs_117m
echo "=== done: $(ls "$OUT")"
