#!/usr/bin/env bash
# One device call for the decode work: the GPU decode tests run while the bench's SWEEP variants
# compile (both CPU-bound), then the timed bench runs alone (sweep at the largest S, table,
# per-kernel breakdown). Usage: bash bench/gpu_decode.sh [S ...]  (default 8192 65536); results in $OUT.
set -u
OUT=${OUT:-/tmp/decode_out}
mkdir -p "$OUT"
S=${*:-8192 65536}
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
( timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_decode.py tests/test_decode.py \
    > "$OUT/tests.txt" 2>&1; echo "pytest rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/tests.txt" ) &
tests_pid=$!
timeout 180 python3 bench/bench_decode.py --precompile-only --jobs 8 --S $S --B 1 16 > "$OUT/precompile.txt" 2>&1
echo "precompile rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/precompile.txt"
wait $tests_pid
tail -25 "$OUT/tests.txt"
timeout 260 python3 bench/bench_decode.py --S $S --B 1 16 --sweep --breakdown --reps 100 --copy-to "$OUT" \
    2>&1 | tee "$OUT/bench.txt" | grep -v "^  sweep" | tail -40
echo "bench done after $(( $(date +%s) - t0 )) s"
grep "^  sweep" "$OUT/bench.txt"
