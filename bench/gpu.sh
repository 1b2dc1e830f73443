#!/usr/bin/env bash
# One GPU call per question: the device-side driver of the benchmarks (run from the repository root).
#
#   bash bench/gpu.sh tests [pytest args]        gpu-marked tests (default: all of tests/)
#   bash bench/gpu.sh attention [T ...]          op speed table + 64k breakdown (fla-core if .whl is carried)
#   bash bench/gpu.sh sweep [GROUP_PREFIX]       kernel-tuning sweep of the op at 64k (e.g. select.)
#   bash bench/gpu.sh branch window|cmp|select [T ...]   one branch against its alternative
#   bash bench/gpu.sh flash [T ...]              at the production shape (HQ=12, H=2, d=64): the window and
#                                                compressed branches on flash-attn vs the own kernels, alone
#                                                and inside the whole op (what sets tuning.flash)
#   bash bench/gpu.sh decode [S ...]             decode tests while the sweep variants compile, then the
#                                                decode table (sweep at the largest S, breakdown)
#   bash bench/gpu.sh train [SEQ ...]            bare vs Ray Train throughput (needs .gpu_bundle), 2 GPUs too
#   bash bench/gpu.sh host [T ...]               the production-shape op as eager calls vs graph replays, and the
#                                                hottest host functions of an eager call (what the eager-op target needs)
#   bash bench/gpu.sh profile MODE [args]        bench/bench_profile.py MODE (kernels, step, ...)
#   bash bench/gpu.sh vs-dense [SEQ ...]         the 125M model trained as NSA and as the dense twin (bare
#                                                loop, bf16, checkpointing, batch 1): tokens/s, memory, loss
#   bash bench/gpu.sh capture [T ...]            capture-model then capture-bench (one call if both fit)
#   bash bench/gpu.sh capture-model [T ...]      train the production TinyLM (SEQ=65536, STEPS=250; reused from
#                                                bench/captured/model while the machine is warm unless RETRAIN=1;
#                                                CAPTURE_LOAD=DIR loads that one), capture layers 0 5 11 at T
#   bash bench/gpu.sh capture-bench [T ...]      the op on bench/captured against the best dense kernel (FA4,
#                                                FA2, cuDNN, flash SDPA), selection tiles TILE_M (default
#                                                "0 1 2 4 8"; 0 = the preset's policy), locality table;
#                                                training 250 steps at 64k takes ~4 min, so capture-model
#                                                and capture-bench fit one call each
#   bash bench/gpu.sh capture-paper [T ...]      the paper shape (HQ=64, H=4, d=128): a 4-layer TinyLM at that attention
#                                                shape trained STEPS=150 at 64k (~3.5 min), layers 0 3 captured to
#                                                bench/captured_paper (default T=65536), then the op on them against FA4
#                                                (selection tiles TILE_M, default "0 1": the preset's policy
#                                                and per token; e.g. TILE_M="0 1 8")
#   bash bench/gpu.sh prod [T ...]               the production shape (HQ=12, H=2, d=64) against cuDNN and FA4 as
#                                                CUDA-graph replays (bench/RESULTS.md, production shape), random, then
#                                                on bench/captured when capture-model made it on this machine
#   bash bench/gpu.sh ncu [T] [KERNEL_REGEX]     Nsight Compute (full set) on the selection kernels of one forward+backward at
#                                                the production shape (default T=16384; the kernels of the second call,
#                                                after compiling): details in $OUT/ncu_details.txt, the hottest source
#                                                lines per kernel in $OUT/ncu_source.txt
#   bash bench/gpu.sh all                        tests, attention, decode
#   eval "$(bash bench/gpu.sh env)"              for ad-hoc python in the same call: installs FA4 (carried halves)
#                                                and fla-core (.whl) as the subcommands do, prints the PYTHONPATH
#   bash bench/gpu.sh bundle-fa4                 (here, not on the GPU) FlashAttention-4 for a machine without
#                                                network: .fa4a (wheels + half the cu13 libraries) and .fa4b
#                                                (the other half), each under one call's 64 MiB carry limit
#
# FlashAttention-4 on the GPU machine: carry .fa4a in one call and .fa4b in the next (back to back: the
# install in $HOME/fa4site survives while the machine stays warm); every subcommand then finds it.
#
# Logs and JSON go to $OUT (default bench/out/gpu); every script also copies its JSON there as
# <name>.json. Time limits per step: T_TESTS, T_BENCH (seconds). TIMER=graph times the op tables (attention,
# flash, capture-bench) as CUDA-graph replays instead of eager calls.
set -uo pipefail
export PYTHONUNBUFFERED=1
# the repository as a package root: the device image has no editable install of nsa
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-bench/out/gpu}
mkdir -p "$OUT"
export OUT
T_TESTS=${T_TESTS:-260}
T_BENCH=${T_BENCH:-500}
TIMER=${TIMER:-eager}     # bench_attention.py --timer: eager calls, or graph (CUDA-graph replays)

gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
}

peers() {  # fla-core (and einops) from carried wheels, when present
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"   # after FA4's paths (fa4), not instead
  fi
}

ray_bundle() {  # Ray and its dependencies from .gpu_bundle (a wheel folder built where there is network; docs/ray.md)
  local site
  site=$(mktemp -d) && tar -xJf .gpu_bundle/ray.tar.xz -C "$site" && \
    python3 -m pip install -q --no-index --no-deps --target "$site" .gpu_bundle/*.whl || exit 1
  export PYTHONPATH="$site:$PWD" RAY_AUTH_MODE=disabled RAY_TRAIN_ENABLE_PRINT_PATCH=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
}

fa4() {  # FlashAttention-4 into $HOME/fa4site from the carried halves (bundle-fa4); silent when absent
  local site=$HOME/fa4site
  if [ -d .fa4a ] && [ ! -d "$site/flash_attn" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .fa4a/*.whl && cp .fa4a/cu13.part.aa "$HOME/"
  fi
  if [ -d .fa4b ] && [ -f "$HOME/cu13.part.aa" ] && [ ! -d "$site/nvidia_cutlass_dsl/cu13" ]; then
    cat "$HOME/cu13.part.aa" .fa4b/cu13.part.ab | xz -dc | tar -x -C "$site"
  fi
  if [ -d "$site/nvidia_cutlass_dsl/cu13" ]; then
    export PYTHONPATH="$site/nvidia_cutlass_dsl/dsl_packages:$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    echo "flash-attn-4: $site" >&2
  fi
}

bundle_fa4() {  # runs on the CPU machine with network (pip download), writes .fa4a and .fa4b
  local tmp plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
  tmp=$(mktemp -d); mkdir -p .fa4a .fa4b
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$tmp" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi torch-c-dlpack-ext \
    quack-kernels || exit 1
  mkdir "$tmp/cu13" && (cd "$tmp/cu13" && unzip -q ../nvidia_cutlass_dsl_libs_cu13-*.whl) && rm "$tmp"/nvidia_cutlass_dsl_libs_cu13-*.whl
  (cd "$tmp/cu13" && tar -cf - . | xz -T0 -7) > "$tmp/cu13.tar.xz"   # 92 MB wheel -> ~65 MB
  split -b 33M "$tmp/cu13.tar.xz" "$tmp/cu13.part."
  mv "$tmp"/*.whl "$tmp/cu13.part.aa" .fa4a/ && mv "$tmp/cu13.part.ab" .fa4b/ && rm -rf "$tmp"
  # .fa4a/.fa4b are in .gitignore, which also keeps them out of `ray job submit --working-dir .` uploads
  du -sh .fa4a .fa4b
}

run_vs_dense() {
  local seqs=${*:-2048 8192 32768 65536}
  python3 pipelines/prepare_data.py --out data/offline_python --overwrite >/dev/null || exit 1
  timeout "$T_BENCH" python3 bench/bench_train.py --skip-ray --steps "${STEPS:-10}" --warmup "${WARMUP:-4}" \
    --vs-dense $seqs --nsa-flash ${NSA_FLASH:-preset} --out "$OUT" data.path=data/offline_python logging.mlflow=false 2>&1 \
    | tee "$OUT/vs_dense.log" | grep -vE "Warning|warn" | tail -16
}

CAPTURE_T="8192 16384 32768 65536"

local_data() {  # the offline text both capture commands train on, made once per machine
  [ -f data/offline_python/manifest.json ] || python3 pipelines/prepare_data.py --out data/offline_python >/dev/null || exit 1
}

run_capture_model() {  # trained model + captures in bench/captured (git-ignored, kept while the machine is warm)
  local T=${*:-$CAPTURE_T} src=()
  if [ -n "${CAPTURE_LOAD:-}" ]; then src=(--load "$CAPTURE_LOAD")
  elif [ -f bench/captured/model/model.pt ] && [ -z "${RETRAIN:-}" ]; then src=(--load bench/captured/model)
  else src=(--seq "${SEQ:-65536}" --steps "${STEPS:-250}")
  fi
  local_data
  timeout "$T_BENCH" python3 bench/capture_inputs.py "${src[@]}" --T $T --out bench/captured \
    data.path=data/offline_python logging.mlflow=false 2>&1 | tee "$OUT/capture.log" | grep -vE "Warning|warn" | tail -24
}

PAPER_MODEL="model.n_layers=4 model.n_heads=64 model.n_kv_groups=4 model.d_k=128 model.d_v=128"

run_capture_paper() {  # bench/captured_paper is git-ignored (bench/captured*), so it stays while the machine is warm
  local T=${*:-65536}
  local_data
  timeout "$T_BENCH" python3 bench/capture_inputs.py --seq 65536 --steps "${STEPS:-150}" --T $T --layers 0 3 \
    --out bench/captured_paper data.path=data/offline_python logging.mlflow=false $PAPER_MODEL 2>&1 \
    | tee "$OUT/capture_paper.log" | grep -vE "Warning|warn" | tail -8
  timeout "$T_BENCH" python3 bench/bench_attention.py --inputs captured:bench/captured_paper --T $T \
    --tile-m ${TILE_M:-0 1} --dense sdpa-cudnn fa4 --iters 5 --timer graph 2>&1 | tee "$OUT/attention_paper_captured.log" \
    | grep -vE "^T=|Warning|warn" | tail -12
}

run_capture_bench() {
  local T=${*:-$CAPTURE_T}
  timeout "$T_BENCH" python3 bench/bench_attention.py --inputs captured:bench/captured --T $T \
    --tile-m ${TILE_M:-0 1 2 4 8} --dense sdpa-cudnn sdpa-flash fa4 fa2 --iters 5 --timer "$TIMER" 2>&1 | tee "$OUT/attention_captured.log" | grep -v "^T=" | tail -40
}

run_prod() {  # graph-timed op at the production shape, random and (when present) captured inputs
  local T=${*:-$CAPTURE_T}
  timeout "$T_BENCH" python3 bench/bench_attention.py --T $T --HQ 12 --H 2 --dk 64 --dv 64 --no-peers \
    --dense sdpa-cudnn fa4 --timer graph 2>&1 | tee "$OUT/attention_prod.log" | grep -vE "^T=|Warning|warn" | tail -12
  if [ -f bench/captured/meta.json ]; then
    timeout "$T_BENCH" python3 bench/bench_attention.py --inputs captured:bench/captured --T $T \
      --dense sdpa-cudnn fa4 --iters 5 --timer graph 2>&1 | tee "$OUT/attention_prod_captured.log" \
      | grep -vE "^T=|Warning|warn" | tail -24
  fi
}

NCU_KERNELS="_slc_bwd_dkdv_kernel|_pair_fwd_kernel|_pair_merge_kernel|_pair_dq_kernel|_select_kernel"

run_ncu() {  # hardware counters of the selection kernels (Firecracker machines; --clock-control none per METHOD.md)
  local T=${1:-16384} re=${2:-$NCU_KERNELS} n
  n=$(( $(tr -cd '|' <<<"$re" | wc -c) + 1 ))   # one launch of each kernel per call: skip the compiling call
  timeout "$T_BENCH" ncu --clock-control none --set full --import-source yes -f -o "$OUT/ncu" \
    --kernel-name "regex:$re" --launch-skip "$n" --launch-count "$n" \
    python3 bench/bench_profile.py ncu-attention --T "$T" --HQ 12 --H 2 --dk 64 --dv 64 > "$OUT/ncu_run.log" 2>&1
  echo "ncu rc=$?"; tail -3 "$OUT/ncu_run.log"
  ncu -i "$OUT/ncu.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
  grep -E "^  _|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Shared Memory Configuration Size|Dynamic Shared|Local Memory|L2 Hit Rate|L1/TEX Hit|Executed Ipc A|No Eligible|One or More" \
    "$OUT/ncu_details.txt" | head -150
  local extras; extras=$(ls -d /opt/nvidia/nsight-compute/*/extras/python 2>/dev/null | tail -1)
  PYTHONPATH="$extras:$PYTHONPATH" python3 bench/bench_profile.py ncu-source "$OUT/ncu.ncu-rep" > "$OUT/ncu_source.txt" 2>&1
  head -120 "$OUT/ncu_source.txt"
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
  timeout "$T_BENCH" python3 bench/bench_attention.py --T $T --breakdown 65536 --iters 5 --timer "$TIMER" 2>&1 \
    | tee "$OUT/attention.log" | tail -25
}

run_flash() {
  local T=${*:-8192 16384 32768 65536} b
  for b in window cmp flash; do
    timeout "$T_BENCH" python3 bench/bench_attention.py --branch "$b" --T $T --HQ 12 --H 2 --dk 64 --dv 64 \
      --iters 5 --timer "$TIMER" 2>&1 | tee "$OUT/attention_$b.log" | grep -vE "^T=|Warning|warn" | tail -22
  done
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
  python3 pipelines/prepare_data.py --out data/offline_python --overwrite >/dev/null || exit 1
  common="data.path=data/offline_python logging.mlflow=false logging.log_every=10"
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
  bundle-fa4) bundle_fa4; exit ;;
  -h|--help|help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit ;;
esac
command -v nvidia-smi >/dev/null && fa4
case "$cmd" in
  tests) gpu_info; run_tests "$@" ;;
  attention) gpu_info; run_attention "$@" ;;
  vs-dense) gpu_info; run_vs_dense "$@" ;;
  sweep) gpu_info; timeout "$T_BENCH" python3 bench/bench_attention.py --T 65536 --no-peers --sweep 65536 \
           --sweep-only "${1:-}" 2>&1 | tee "$OUT/sweep.log" | grep "^sweep" ;;
  branch) gpu_info; b=${1:?branch window, cmp or select}; shift
          timeout "$T_BENCH" python3 bench/bench_attention.py --branch "$b" ${*:+--T $*} 2>&1 \
            | tee "$OUT/attention_$b.log" | tail -20 ;;
  decode) gpu_info; run_decode "$@" ;;
  flash) gpu_info; run_flash "$@" ;;
  prod) gpu_info; run_prod "$@" ;;
  train) nvidia-smi -L; run_train "$@" ;;
  host) gpu_info; for tm in eager graph; do   # the production shape's op, eager calls against graph replays
          timeout "$T_BENCH" python3 bench/bench_attention.py --T ${*:-8192 16384} --HQ 12 --H 2 --dk 64 --dv 64 \
            --dense fa4 --no-peers --timer $tm $([ $tm = eager ] && echo --host-profile 3) 2>&1 \
            | tee "$OUT/host_$tm.log" | grep -vE "Warning|warn" | tail -24
        done ;;
  profile) gpu_info; m=${1:?profile mode: kernels, step, ncu-attention or ncu-decode}; shift
           timeout "$T_BENCH" python3 bench/bench_profile.py "$m" "$@" 2>&1 \
             | grep -vE "USDT|_warn_once|Profiler clears" | tee "$OUT/profile_$m.log" | tail -60 ;;
  capture) gpu_info; run_capture_model "$@"; run_capture_bench "$@" ;;
  capture-model) gpu_info; run_capture_model "$@" ;;
  capture-bench) gpu_info; run_capture_bench "$@" ;;
  capture-paper) gpu_info; run_capture_paper "$@" ;;
  ncu) gpu_info; run_ncu "$@" ;;
  all) gpu_info; run_tests; run_attention; run_decode ;;
  env) peers >&2; echo "export PYTHONPATH=\"$PYTHONPATH\"" ;;
  -h|--help|help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
  *) echo "bench/gpu.sh: unknown command '$cmd' (bash bench/gpu.sh --help lists them)" >&2; exit 2 ;;
esac
