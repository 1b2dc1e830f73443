#!/usr/bin/env bash
# One GPU call: every gpu-marked test, then the attention benchmark (with fla-core from .whl when carried)
# and a tile sweep at 64k. Logs and JSON go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-bench/out}; mkdir -p "$OUTDIR"
nvidia-smi -L
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
fi
timeout ${T_TESTS:-260} python3 -m pytest -q -m gpu tests/ -p no:cacheprovider -rA 2>&1 | grep -vE "DEBUG|^\s*$" > "$OUTDIR/pytest_gpu.log"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUTDIR/pytest_gpu.log" | tail -40
timeout ${T_BENCH:-250} python3 bench/bench_attention.py --T 8192 16384 32768 65536 --breakdown 65536 \
  --sweep ${SWEEP_T:-65536} --iters 5 --copy-to "$OUTDIR" 2>&1 | tee "$OUTDIR/bench_attention.log" | tail -45
