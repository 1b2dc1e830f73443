#!/usr/bin/env bash
# The issue-3 training benchmarks on a GPU machine without network (run through the device tool with
# .gpu_bundle carried: bash ../shared/tools/gpu_bundle.sh .gpu_bundle). 125M prod profile, bf16:
# bare vs Ray Train at seq 2048 and 8192 on one GPU, then Ray Train on 2 GPUs (DDP/NCCL) for scaling.
set -uo pipefail
SITE=$(mktemp -d) && tar -xJf .gpu_bundle/ray.tar.xz -C "$SITE" && \
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu_bundle/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled RAY_TRAIN_ENABLE_PRINT_PATCH=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUTDIR=${OUT:-bench/out}
nvidia-smi -L
python3 pipelines/prepare_data.py --out data/fineweb_local --overwrite >/dev/null || exit 1
common="data.path=data/fineweb_local logging.mlflow=false"
python3 bench/bench_train.py --steps ${STEPS:-30} --warmup 5 $common runtime.num_workers=1 2>&1 | tee "$OUTDIR/t2048.log" | grep -vE "Dataset|Progress bars|core_worker"; mv -f "$OUTDIR/bench_train.json" "$OUTDIR/t2048.json" 2>/dev/null
python3 bench/bench_train.py --steps ${STEPS8K:-12} --warmup 3 $common runtime.num_workers=1 train.seq_len=8192 2>&1 | tee "$OUTDIR/t8192.log" | grep -vE "Dataset|Progress bars|core_worker"; mv -f "$OUTDIR/bench_train.json" "$OUTDIR/t8192.json" 2>/dev/null
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  python3 bench/bench_train.py --steps ${STEPS:-30} --warmup 5 --skip-bare $common runtime.num_workers=2 2>&1 | tee "$OUTDIR/t2048x2.log" | grep -vE "Dataset|Progress bars|core_worker"; mv -f "$OUTDIR/bench_train.json" "$OUTDIR/t2048x2.json" 2>/dev/null
fi
