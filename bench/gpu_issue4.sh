#!/usr/bin/env bash
# One device call for the prefill kernels of issue 4: GPU tests, the compressed-branch comparison
# (Triton vs dense SDPA), a selection-kernel sweep at 64k, then the attention table.
# Usage: bash bench/gpu_issue4.sh [T ...]   (default 8192 16384 32768 65536); results in $OUT.
set -u
OUT=${OUT:-/tmp/issue4_out}
mkdir -p "$OUT"
T=${*:-8192 16384 32768 65536}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
[ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_gpu.py -s \
    > "$OUT/gputest.txt" 2>&1; tail -3 "$OUT/gputest.txt" 2>/dev/null
[ -n "${SKIP_CMP:-}" ] || { timeout 150 python3 bench/bench_cmp_dense.py --T $T --copy-to "$OUT" > "$OUT/cmpd.txt" 2>&1;
    tail -14 "$OUT/cmpd.txt" | head -12; }
[ -n "${SKIP_SWEEP:-}" ] || { timeout 240 python3 bench/bench_attention.py --T 65536 --no-peers --sweep 65536 \
    --sweep-only "${SWEEP_ONLY:-select.}" --out "$OUT/sweep" > "$OUT/sweep.txt" 2>&1; grep "^sweep" "$OUT/sweep.txt"; }
PEERS=--no-peers
if ls .whl/fla_core*.whl >/dev/null 2>&1; then   # fla-core as a peer when its wheel was carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PEERS=
fi
timeout 300 python3 bench/bench_attention.py --T $T $PEERS --breakdown 65536 --iters 5 --copy-to "$OUT" \
    > "$OUT/attn.txt" 2>&1; echo "attention rc=$?"
grep "^breakdown" "$OUT/attn.txt"; tail -12 "$OUT/attn.txt"
