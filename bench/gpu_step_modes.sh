#!/usr/bin/env bash
# Issue-3 step-mode checks on one GPU (device tool; .gpu_bundle carried for the Ray part):
# 1. graphed/compiled step == eager step (pytest -m gpu), 2. host vs GPU time per step mode,
# 3. bare vs Ray Train throughput on the prod profile (compile + CUDA graph on by default).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-bench/out}; mkdir -p "$OUTDIR"
nvidia-smi -L
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/test_train_graphed.py -p no:cacheprovider > "$OUTDIR/pytest_graphed.log" 2>&1
  grep -E "passed|failed|Error|error" "$OUTDIR/pytest_graphed.log" | tail -8
fi
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  timeout 300 python3 bench/profile_step.py --variants ${VARIANTS:-graph,compile_graph} --steps 10 --top 8 2>&1 \
    | grep -vE "USDT|_warn_once|Profiler clears" | tee "$OUTDIR/profile_modes.log" | tail -40
  cp bench/out/profile_step_*.json "$OUTDIR/" 2>/dev/null
fi
if [ "${SKIP_RAY:-0}" != 1 ]; then
  SITE=$(mktemp -d) && tar -xJf .gpu_bundle/ray.tar.xz -C "$SITE" && \
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu_bundle/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD" RAY_AUTH_MODE=disabled RAY_TRAIN_ENABLE_PRINT_PATCH=0
  python3 pipelines/prepare_data.py --out data/fineweb_local --overwrite >/dev/null || exit 1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  common="data.path=data/fineweb_local logging.mlflow=false logging.log_every=10 ${RAY_ARGS:-}"
  for seq in ${SEQS:-2048 8192}; do
    python3 bench/bench_train.py --steps ${STEPS:-30} --warmup 8 $common runtime.num_workers=1 train.seq_len=$seq 2>&1 \
      | tee "$OUTDIR/t$seq.log" | grep -vE "Dataset|Progress bars|core_worker" | tail -8
    mv -f "$OUTDIR/bench_train.json" "$OUTDIR/t$seq.json" 2>/dev/null
  done
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    python3 bench/bench_train.py --steps ${STEPS:-30} --warmup 8 --skip-bare $common runtime.num_workers=2 2>&1 \
      | tee "$OUTDIR/t2048x2.log" | grep -vE "Dataset|Progress bars|core_worker" | tail -8
    mv -f "$OUTDIR/bench_train.json" "$OUTDIR/t2048x2.json" 2>/dev/null
  fi
fi
