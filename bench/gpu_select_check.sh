#!/bin/bash
# One GPU call for the fused selection kernel (scores + top-n): GPU tests, the attention benchmark at
# 64k with its per-stage breakdown, a tile sweep of the fused kernel, and the kernel tests natively.
# Results and logs go to $OUT (default bench/out/gpu_select). Usage: bash bench/gpu_select_check.sh
set -u
OUT=${OUT:-bench/out/gpu_select}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt" 2>&1
# warm Triton's cache (CPU-bound compiles, in parallel) and run the selection tests natively while the
# GPU tests run; nothing is timed before `wait`
for i in 0 1 2 3 4 5 6; do
  timeout 190 python3 bench/bench_select.py --tile $i --iters 1 --out "$OUT/warm" > "$OUT/warm_$i.log" 2>&1 &
done
timeout 190 python3 - > "$OUT/warm_nsa.log" 2>&1 <<'PY' &
import sys; sys.path.insert(0, "bench")
import torch, bench_attention as ba
from nsa.ops.triton import nsa_attention_triton
x = ba.nsa_inputs(1, 4096, 64, 4, 128, 128)
o, _ = nsa_attention_triton(*x, **ba.HP)
torch.autograd.grad(o, x, torch.randn_like(o))
torch.cuda.synchronize(); print("warm ok")
PY
(timeout 190 python3 -m pytest -q tests/test_triton_scores.py > "$OUT/pytest_scores.log" 2>&1;
 echo "pytest_scores rc=$?" >> "$OUT/pytest_scores.log") &
(timeout 190 python3 -m pytest -q tests/test_triton_kernels.py > "$OUT/pytest_kernels.log" 2>&1;
 echo "pytest_kernels rc=$?" >> "$OUT/pytest_kernels.log") &
timeout 170 python3 -m pytest -q -m gpu tests/test_triton_gpu.py -s > "$OUT/pytest_gpu.log" 2>&1
echo "pytest_gpu rc=$?" >> "$OUT/pytest_gpu.log"
wait
PEERS=""; python3 bench/bench_attention.py --help 2>/dev/null | grep -q -- --no-peers && PEERS=--no-peers
timeout 75 python3 bench/bench_attention.py --T 65536 --breakdown 65536 $PEERS --out "$OUT" > "$OUT/attention.log" 2>&1
echo "attention rc=$?" >> "$OUT/attention.log"
timeout 30 python3 bench/bench_select.py --out "$OUT" > "$OUT/select.log" 2>&1
echo "select rc=$?" >> "$OUT/select.log"
for f in pytest_gpu attention select pytest_scores pytest_kernels; do echo "== $f"; tail -n 25 "$OUT/$f.log"; done
