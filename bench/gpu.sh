#!/usr/bin/env bash
# One GPU call per question: the device-side driver of the benchmarks (run from the repository root).
#
#   bash bench/gpu.sh tests [pytest args]        gpu-marked tests (default: all of tests/)
#   bash bench/gpu.sh attention [T ...]          op speed table + 64k breakdown (fla-core if .whl is carried)
#   bash bench/gpu.sh sweep [GROUP_PREFIX]       kernel-tuning sweep of the op at 64k (e.g. select.)
#   bash bench/gpu.sh branch window|cmp|select [T ...]   one branch against its alternative
#   bash bench/gpu.sh decode [S ...]             decode tests while the sweep variants compile, then the
#                                                decode table (sweep at the largest S, breakdown)
#   bash bench/gpu.sh train [SEQ ...]            bare vs Ray Train throughput (needs .gpu_bundle), 2 GPUs too
#   bash bench/gpu.sh profile MODE [args]        bench/bench_profile.py MODE (kernels, step, ...)
#   bash bench/gpu.sh all                        tests, attention, decode
#
# Logs and JSON go to $OUT (default bench/out/gpu); every script also copies its JSON there as
# <name>.json. Time limits per step: T_TESTS, T_BENCH (seconds).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export OUT
T_TESTS=${T_TESTS:-260}
T_BENCH=${T_BENCH:-500}

gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
}

peers() {  # fla-core (and einops) from carried wheels, when present
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH="/tmp/site:$PWD"
  fi
}

ray_bundle() {  # Ray and its dependencies from .gpu_bundle (../shared/tools/gpu_bundle.sh .gpu_bundle)
  local site
  site=$(mktemp -d) && tar -xJf .gpu_bundle/ray.tar.xz -C "$site" && \
    python3 -m pip install -q --no-index --no-deps --target "$site" .gpu_bundle/*.whl || exit 1
  export PYTHONPATH="$site:$PWD" RAY_AUTH_MODE=disabled RAY_TRAIN_ENABLE_PRINT_PATCH=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

run_tests() {
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(tests/)
  timeout "$T_TESTS" python3 -m pytest -q -m gpu -p no:cacheprovider -rA "${args[@]}" > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_gpu.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_gpu.log" | tail -40
}

run_attention() {
  local T=${*:-8192 16384 32768 65536}
  peers
  timeout "$T_BENCH" python3 bench/bench_attention.py --T $T --breakdown 65536 --iters 5 2>&1 \
    | tee "$OUT/attention.log" | tail -25
}

run_decode() {
  local S=${*:-8192 65536} t0
  t0=$(date +%s)
  export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
  ( timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_triton_decode.py tests/test_decode.py \
      > "$OUT/pytest_decode.log" 2>&1; echo "pytest rc=$? after $(( $(date +%s) - t0 )) s" >> "$OUT/pytest_decode.log" ) &
  local tests_pid=$!
  timeout 180 python3 bench/bench_decode.py --precompile-only --jobs 8 --S $S --B 1 16 > "$OUT/precompile.log" 2>&1
  echo "precompile rc=$? after $(( $(date +%s) - t0 )) s"
  wait $tests_pid
  tail -5 "$OUT/pytest_decode.log"
  timeout "$T_BENCH" python3 bench/bench_decode.py --S $S --B 1 16 --sweep --breakdown --reps 100 2>&1 \
    | tee "$OUT/decode.log" | grep -v "^  sweep" | tail -30
  grep "^  sweep" "$OUT/decode.log"
}

run_train() {
  local seqs=${*:-2048 8192} common
  ray_bundle
  python3 pipelines/prepare_data.py --out data/fineweb_local --overwrite >/dev/null || exit 1
  common="data.path=data/fineweb_local logging.mlflow=false logging.log_every=10"
  for seq in $seqs; do
    python3 bench/bench_train.py --steps "${STEPS:-30}" --warmup 8 --out "$OUT" --copy-to "$OUT/t$seq" $common \
      runtime.num_workers=1 train.seq_len="$seq" 2>&1 | tee "$OUT/train_t$seq.log" \
      | grep -vE "Dataset|Progress bars|core_worker" | tail -8
  done
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    python3 bench/bench_train.py --steps "${STEPS:-30}" --warmup 8 --skip-bare --out "$OUT" --copy-to "$OUT/t2048x2" \
      $common runtime.num_workers=2 2>&1 | tee "$OUT/train_t2048x2.log" | grep -vE "Dataset|Progress bars|core_worker" | tail -8
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  tests) gpu_info; run_tests "$@" ;;
  attention) gpu_info; run_attention "$@" ;;
  sweep) gpu_info; timeout "$T_BENCH" python3 bench/bench_attention.py --T 65536 --no-peers --sweep 65536 \
           --sweep-only "${1:-}" 2>&1 | tee "$OUT/sweep.log" | grep "^sweep" ;;
  branch) gpu_info; b=${1:?branch window, cmp or select}; shift
          timeout "$T_BENCH" python3 bench/bench_attention.py --branch "$b" ${*:+--T $*} 2>&1 \
            | tee "$OUT/attention_$b.log" | tail -20 ;;
  decode) gpu_info; run_decode "$@" ;;
  train) nvidia-smi -L; run_train "$@" ;;
  profile) gpu_info; m=${1:?profile mode: kernels, step, ncu-attention or ncu-decode}; shift
           timeout "$T_BENCH" python3 bench/bench_profile.py "$m" "$@" 2>&1 \
             | grep -vE "USDT|_warn_once|Profiler clears" | tee "$OUT/profile_$m.log" | tail -60 ;;
  all) gpu_info; run_tests; run_attention; run_decode ;;
  -h|--help|help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
  *) echo "bench/gpu.sh: unknown command '$cmd' (bash bench/gpu.sh --help lists them)" >&2; exit 2 ;;
esac
