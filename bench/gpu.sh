#!/usr/bin/env bash
# One GPU call per question: the device-side driver of the benchmarks (run from the repository root).
#
#   bash bench/gpu.sh tests [pytest args]        gpu-marked tests (default: all of tests/, TEST_JOBS=3 groups)
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
#                                                loop, bf16, checkpointing, batch 1): tokens/s, memory, loss;
#                                                VS_EXTRA=runtime.cuda_graph=false: the eager loop (the op
#                                                replays its own per-call graphs; NSA_EAGER_GRAPHS=off: not)
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
# The Ray route on a 2-GPU host (issues 47, 49; carry .gpu_bundle; call plan and durations: docs/gpu_runbook.md).
# job, scale, heal, past-one write <name>.json and <name>.log to $OUT (nothing else: a call returns 8 files), run
# under /tmp/nsa-gpu and stop by T_RUN seconds (default 540) with what ran reported. DRY_RUN=1 resolves their configs;
# JOB_EXTRA, RUN_EXTRA (scale, heal, past-one), LANES_EXTRA append overrides (a shrunk model for a CPU trial).
#   bash bench/gpu.sh bundle-ray                 (here, not on the GPU) .gpu_bundle/site.tar.xz: Ray (train, tune,
#                                                dashboard/job API), MLflow and what they need beyond the GPU image
#   bash bench/gpu.sh job                        local_head.sh start, prepare_data as a job, `ray job submit -- python
#                                                pipelines/prod_50k.py` on 2 GPU workers (JOB_STEPS=1200, save every
#                                                JOB_SAVE=300), rank 1's worker SIGKILLed after step JOB_KILL_AT=700;
#                                                restart step, losses run twice, seconds to recover; head stopped
#   bash bench/gpu.sh scale [SEQ ...]            NSA and the dense twin, 1 and 2 GPUs, graphed step (captured
#                                                all-reduce) at every SEQ (default 8192 32768 65536) and DDP eager at
#                                                EAGER_SEQS (8192 32768): tokens/s, efficiency, NSA/dense; files
#                                                scale.* (no SEQ) or scale_<SEQ>_...*
#   bash bench/gpu.sh heal                       2 GPUs, a stall on rank 0 before step HEAL_AT=170 (rank 1 waits in the
#                                                NCCL all-reduce), train.on_stall=restart, stall_seconds 20; losses
#                                                against the same run without the stall, stall-to-recovery seconds
#   bash bench/gpu.sh lanes-gpu [LANE,...]       lanes/ab_grid.py on prod_50k with 6 layers, LANES_STEPS=30, one GPU per
#                                                lane, two at a time; summary, plots and the MLflow store
#   bash bench/gpu.sh past-one                   125M at 128k on 1 GPU vs 256k with context_parallel=2; the 1B FSDP2
#                                                profile on 2 GPUs at 32k (tok/s, peak memory per GPU), resumed from
#                                                its sharded checkpoint on 1 GPU (losses compared)
#   bash bench/gpu.sh passkey [nsa|dense ...]   pipelines/configs/passkey.yaml (125M, 4 x 8k passkey rows) trained on 1 GPU
#                                                as NSA and/or the dense twin (train stops by T_PASSKEY s, default T_RUN
#                                                - 120), then evaluated at 4k-32k: passkey_<a>.json (eval), passkey_<a>.png,
#                                                passkey_<a>_train.json (metrics.json). A run longer than one call:
#                                                PASSKEY_HALT_S=<s> halts it through its .HALT file after s seconds
#                                                (checkpoint, then stop); PASSKEY_KEEP=1 in the next call (machine still
#                                                warm) resumes it by name; PASSKEY_EVAL=0 skips a call's evaluation
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
T_TESTS=${T_TESTS:-420}
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

ray_bundle() {  # Ray (+ MLflow) from .gpu_bundle (bundle-ray, built where there is network; docs/ray.md), once per machine
  local site=$HOME/raysite
  if [ -n "${DRY_RUN:-}" ]; then MLFLOW=false; return; fi   # DRY_RUN=1: resolve every config, run nothing (CPU)
  # a Python that has Ray already (a CPU trial here) uses its own
  if [ ! -f "$site/.complete" ] && ! python3 -c "import ray.dashboard.optional_deps" 2>/dev/null; then
    rm -rf "$site" && mkdir -p "$site/bin" || exit 1
    if [ -f .gpu_bundle/site.tar.xz ]; then
      tar -xJf .gpu_bundle/site.tar.xz -C "$site" || exit 1
    elif [ ! -f .gpu_bundle/ray.tar.xz ]; then
      echo "no Ray on this machine: carry .gpu_bundle (bash bench/gpu.sh bundle-ray builds it)" >&2; exit 1
    else   # the older layout: ray.tar.xz + wheels
      tar -xJf .gpu_bundle/ray.tar.xz -C "$site" && \
        python3 -m pip install -q --no-index --no-deps --target "$site" .gpu_bundle/*.whl || exit 1
    fi
    # the `ray` CLI (local_head.sh, ray job submit): a --target install has no usable console script
    printf '#!/usr/bin/env python3\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n' > "$site/bin/ray"
    # local_head.sh and `ray job submit -- python ...` call `python`; the image may name it python3 only
    command -v python >/dev/null || ln -s "$(command -v python3)" "$site/bin/python"
    chmod +x "$site/bin/ray" && touch "$site/.complete"
    # the image packages Ray leans on (IMAGE_HAS): a dashboard or job failure may be an old one of these
    python3 -c 'import importlib.metadata as m
def v(p):
    try:
        return m.version(p)
    except m.PackageNotFoundError:
        return "missing"
print("ray bundle over the image:", *(f"{p}={v(p)}" for p in ("aiohttp", "grpcio", "packaging", "pyarrow",
                                                               "pandas", "click", "msgpack", "requests")))' || true
  fi
  export PATH="$site/bin:$PATH" PYTHONPATH="$site:$PYTHONPATH" RAY_AUTH_MODE=disabled RAY_TRAIN_ENABLE_PRINT_PATCH=0
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 RAY_USAGE_STATS_ENABLED=0
  python3 -c "import mlflow" 2>/dev/null && MLFLOW=true || MLFLOW=false   # the older bundle has no MLflow
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

# Ray's and MLflow's needs that the GPU image already holds (its package list in the device notes, 2026-11-17):
# not bundled. protobuf is bundled all the same: Ray's generated code wants the runtime it was tested with here.
IMAGE_HAS="aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click cloudpickle
  filelock frozenlist fsspec grpcio h11 idna markupsafe msgpack multidict numpy packaging pandas prometheus-client
  propcache pyarrow python-dateutil pyyaml requests six typing-extensions urllib3 wrapt yarl zipp"
# needed only for GCP/Databricks credentials and py-spy's profiler (a 3 MB binary): never used on that host
# (cryptography stays: MLflow's SQLite store imports it)
RAY_UNUSED="py-spy google-api-core google-auth pyasn1 pyasn1-modules proto-plus"

bundle_ray() {  # runs on the CPU machine with network (pip download): .gpu_bundle/site.tar.xz, one site folder
  # BUNDLE_PY/BUNDLE_DIR: another Python and folder, to try the bundle here (the GPU image's Python is 3.12)
  local tmp w n dir=${BUNDLE_DIR:-.gpu_bundle} keep=() plat=(--only-binary=:all: --python-version "${BUNDLE_PY:-3.12}"
    --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  tmp=$(mktemp -d)
  python3 -m pip download -q "${plat[@]}" -d "$tmp/whl" -c constraints.txt "ray[default,train,tune]==2.60.0" \
    mlflow-skinny mlflow-tracing sqlalchemy alembic protobuf || exit 1
  for w in "$tmp"/whl/*.whl; do
    n=$(basename "$w" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    case " $(echo $IMAGE_HAS $RAY_UNUSED) " in *" $n "*) ;; *) keep+=("$w") ;; esac
  done
  python3 -m pip install -q --no-deps --no-compile "${plat[@]}" --target "$tmp/site" "${keep[@]}" || exit 1
  # console scripts name this machine's python; Java workers, RLlib, Ray LLM and source maps are never used
  rm -rf "$tmp/site/bin" "$tmp/site/ray/jars" "$tmp/site/ray/rllib" "$tmp/site/ray/llm"
  find "$tmp/site" -name "*.map" -delete
  mkdir -p "$dir" && rm -f "$dir/site.tar.xz" "$dir/CONTENTS"
  (cd "$tmp/site" && tar -cf - .) | xz -T0 -9e > "$dir/site.tar.xz" && rm -rf "$tmp"
  # .gpu_bundle is in .gitignore, so `ray job submit --working-dir .` does not upload it
  printf '%s\n' "${keep[@]##*/}" > "$dir/CONTENTS"
  du -sh "$dir/site.tar.xz"
}

run_vs_dense() {
  local seqs=${*:-2048 8192 32768 65536}
  python3 pipelines/prepare_data.py --out data/offline_python --overwrite >/dev/null || exit 1
  timeout "$T_BENCH" python3 bench/bench_train.py --skip-ray --steps "${STEPS:-10}" --warmup "${WARMUP:-4}" \
    --vs-dense $seqs --nsa-flash ${NSA_FLASH:-preset} --out "$OUT" data.path=data/offline_python logging.mlflow=false \
    ${VS_EXTRA:-} 2>&1 \
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

run_tests() {  # no args: every gpu-marked file, in TEST_JOBS parallel pytest groups (one serial run passes 600 s)
  if [ $# -gt 0 ]; then
    timeout "$T_TESTS" python3 -m pytest -q -m gpu -p no:cacheprovider -rA "$@" > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest_gpu.log"
    grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/pytest_gpu.log" | tail -40
    return
  fi
  local jobs=${TEST_JOBS:-3} g files
  # files by gpu-test count, dealt greedily into the emptiest group (Triton compiles spread over the cores)
  python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only tests/ 2>/dev/null | grep "::" | cut -d: -f1 \
    | sort | uniq -c | sort -rn | awk -v n="$jobs" '{m=0; for (i=1;i<n;i++) if (c[i]<c[m]) m=i; c[m]+=$1;
      f[m]=f[m] " " $2} END {for (i=0;i<n;i++) print f[i]}' > "$OUT/test_groups.txt"
  g=0
  while read -r files; do
    [ -n "$files" ] || continue
    ( timeout "$T_TESTS" python3 -m pytest -q -m gpu -p no:cacheprovider -rA $files > "$OUT/pytest_gpu_$g.log" 2>&1
      echo "pytest rc=$?" >> "$OUT/pytest_gpu_$g.log" ) &
    g=$((g + 1))
  done < "$OUT/test_groups.txt"
  wait
  cat "$OUT"/pytest_gpu_*.log > "$OUT/pytest_gpu.log" && rm -f "$OUT"/pytest_gpu_*.log
  grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/pytest_gpu.log" | tail -40
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

# ------------------------------------------------------------------ the Ray route on 2 GPUs (issues 47, 49)
GPU_WORK=/tmp/nsa-gpu    # run roots and the head's storage: outside the tree, so never uploaded by a job submit
T_RUN=${T_RUN:-540}      # each subcommand's cap (one call is 600 s; a halted case may take a minute more)
GR=cluster/scripts/gpu_runs.py
RUN_COMMON="logging.mlflow=false logging.stats_every=0 logging.tensorboard=false train.eval_every=0"

job_submit() {  # URL CMD...: `ray job submit` to the local head, again while its job agent is still starting
  local url=$1 i rc=1; shift
  for i in $(seq 1 15); do
    timeout "${T_SUBMIT:-300}" ray job submit --address "$url" --working-dir . --runtime-env cluster/runtime_env.yaml \
      -- "$@" 2>&1 \
      | tee "$GPU_WORK/submit.log"
    rc=${PIPESTATUS[0]}
    grep -q "No available agent" "$GPU_WORK/submit.log" || return "$rc"
    sleep 2
  done
  return "$rc"
}

run_job() {  # issue 47.1: the headline command on a 2-GPU head; rank 1's worker SIGKILLed mid-run
  local store=$GPU_WORK/store name url t0 t_data rc kpid at=${JOB_KILL_AT:-700} args
  name=job-$(date +%H%M%S)
  args=("logging.name=$name" data.path=data/offline_python runtime.num_workers=2 runtime.gpus=2
        "train.steps=${JOB_STEPS:-1200}" "train.save_every=${JOB_SAVE:-300}" "train.eval_every=${JOB_SAVE:-300}"
        train.eval_batches=4 logging.log_every=1 ${JOB_EXTRA:-})   # JOB_EXTRA: a CPU trial's shrunk model
  # log_every=1: a logged loss is the mean since the last log, and a restart logs its first step, so only
  # per-step losses compare across a restart
  ray_bundle
  if [ -n "${DRY_RUN:-}" ]; then python3 pipelines/prod_50k.py --print-config "${args[@]}" logging.mlflow=false; return; fi
  export NSA_HEAD_DIR=$GPU_WORK/head
  mkdir -p "$store" && rm -f "$GPU_WORK/job_kill.json" && t0=$(date +%s)   # no earlier call's kill record
  bash cluster/scripts/local_head.sh start --storage "$store" ${JOB_HEAD_CPUS:+-- "--num-cpus=$JOB_HEAD_CPUS"} || return 1
  url=$(cat "$NSA_HEAD_DIR/address")
  job_submit "$url" python pipelines/prepare_data.py --out data/offline_python
  t_data=$(( $(date +%s) - t0 ))
  # a real kill from outside (as the OOM killer or a lost node): the worker process whose heartbeat shows the step
  timeout "$T_RUN" python3 "$GR" kill-at "$store/runs/$name" --step "$at" --rank 1 --out "$GPU_WORK/job_kill.json" &
  kpid=$!
  T_SUBMIT=$(( T_RUN - t_data )) job_submit "$url" python pipelines/prod_50k.py "${args[@]}" "logging.mlflow=$MLFLOW"
  rc=$?
  kill "$kpid" 2>/dev/null; wait "$kpid"
  bash cluster/scripts/local_head.sh stop
  python3 "$GR" report "$store/runs/$name" --event "$GPU_WORK/job_kill.json" --note "submit_rc=$rc" \
    --note "prepare_data_job_s=$t_data" --note "wall_s=$(( $(date +%s) - t0 ))" --out "$OUT/job.json"
}

ray_runs() {  # OUT_NAME CASE...: gpu_runs.py runs (one process, one Ray instance) into $GPU_WORK/OUT_NAME
  local name=$1; shift
  [ -n "${DRY_RUN:-}" ] || local_data
  # fresh runs: a run dir of an earlier call on this warm machine would be resumed by name (train.resume=auto)
  [ -n "${DRY_RUN:-}" ] || rm -rf "${GPU_WORK:?}/$name" "$GPU_WORK/$name.json"
  # --foreground: the SIGTERM reaches the driver alone, which halts the case at a step boundary with its steps
  # kept (the Ray workers would die of their own SIGTERM otherwise); KILL 60 s later if that step is longer
  timeout --foreground -k 60 "$T_RUN" python3 "$GR" runs --root "$GPU_WORK/$name" --out "$GPU_WORK/$name.json" ${DRY_RUN:+--dry-run} \
    --steps "${STEPS:-10}" --warmup "${WARMUP:-6}" \
    --common "data.path=$PWD/data/offline_python $RUN_COMMON ${RUN_EXTRA:-}" "$@"   # RUN_EXTRA: a CPU trial's model
}

run_scale() {  # issue 47.2: NSA and the dense twin, 1 vs 2 GPUs, graphed step vs DDP eager
  local seqs=${*:-8192 32768 65536} eager=" ${EAGER_SEQS-8192 32768} " w s a c cases=()
  ray_bundle
  for s in $seqs; do      # one length's rows complete before the next: a call cut short keeps whole comparisons
    for w in 1 2; do
      for a in nsa dense; do
        c="model.attention=$a train.seq_len=$s runtime.num_workers=$w runtime.gpus=$w"
        cases+=(--case "${a}_${s}_${w}gpu_graph $c")
        [ "$w" = 2 ] && [[ $eager == *" $s "* ]] && cases+=(--case "${a}_${s}_${w}gpu_ddp $c runtime.cuda_graph=false")
      done
    done
  done
  ray_runs "$RUN_NAME" "${cases[@]}" || [ -z "${DRY_RUN:-}" ] || return
  [ -n "${DRY_RUN:-}" ] || python3 "$GR" table "$GPU_WORK/$RUN_NAME.json" --out "$OUT/$RUN_NAME.json"
}

run_heal() {  # issue 47.3: a stall on one rank inside the NCCL all-reduce heals by restart
  local steps=${HEAL_STEPS:-300} save=${HEAL_SAVE:-100} at=${HEAL_AT:-170} c
  ray_bundle
  c="runtime.num_workers=2 runtime.gpus=2 train.steps=$steps train.save_every=$save logging.log_every=1"
  c+=" train.stall_seconds=${HEAL_STALL_S:-20} train.on_stall=restart"
  ray_runs heal --case "heal_ref $c" --case "heal_stall $c runtime.fault=stall@$at" || [ -z "${DRY_RUN:-}" ] || return
  [ -n "${DRY_RUN:-}" ] || python3 "$GR" report "$GPU_WORK/heal/heal_stall" --reference "$GPU_WORK/heal/heal_ref" \
    --runs "$GPU_WORK/heal.json" --out "$OUT/heal.json"
}

run_past_one() {  # issue 49: context parallelism at 256k, FSDP2 1B at 32k and its resume on one GPU
  local fsdp="@pipelines/configs/fsdp_1b.yaml warmup=3 train.steps=8 train.save_every=4 logging.log_every=1"
  local ck=$GPU_WORK/past_one/fsdp2_32k/checkpoint_00000004
  ray_bundle
  # FSDP first: the CP row runs the op's torch path (slowest, docs/parallel.md) and goes last
  STEPS=${STEPS:-3} WARMUP=${WARMUP:-5} ray_runs past_one \
    --case "fsdp2_32k $fsdp runtime.num_workers=2 runtime.gpus=2" \
    --case "fsdp1_resume $fsdp runtime.num_workers=1 runtime.gpus=1 train.resume_from=$ck" \
    --case "cp1_128k train.seq_len=131072 runtime.num_workers=1 runtime.gpus=1" \
    --case "cp2_256k warmup=1 train.seq_len=262144 runtime.num_workers=2 runtime.gpus=2 runtime.context_parallel=2" \
    || [ -z "${DRY_RUN:-}" ] || return
  [ -n "${DRY_RUN:-}" ] || python3 "$GR" report "$GPU_WORK/past_one/fsdp1_resume" \
    --reference "$GPU_WORK/past_one/fsdp2_32k" --runs "$GPU_WORK/past_one.json" --out "$OUT/past_one.json"
}

run_lanes_gpu() {  # issue 47.4: the lanes on GPUs, one GPU per lane, two lanes at a time
  local grid=$GPU_WORK/lanes/gpu-lanes f rc
  ray_bundle; [ -n "${DRY_RUN:-}" ] || local_data
  timeout --foreground -k 30 "$T_RUN" python3 lanes/ab_grid.py ${DRY_RUN:+--print-config} --base pipelines/configs/prod_50k.yaml \
    ${1:+--only "$1"} --steps "${LANES_STEPS:-30}" --max-concurrent 2 --stall-seconds 120 --hang-grace 60 --name gpu-lanes \
    --overwrite --allow-failures "data.path=$PWD/data/offline_python" "logging.root=$GPU_WORK/lanes" \
    model.n_layers=6 "logging.mlflow=$MLFLOW" ${LANES_EXTRA:-}   # LANES_EXTRA: a CPU trial's model
  rc=$?
  [ -z "${DRY_RUN:-}" ] || return "$rc"
  for f in lanes_summary.json lanes_summary.md lanes_loss.png lanes_toks_per_s.png; do
    [ -f "$grid/$f" ] && cp "$grid/$f" "$OUT/"
  done
  [ -f "$GPU_WORK/lanes/mlflow.db" ] && xz -c "$GPU_WORK/lanes/mlflow.db" > "$OUT/lanes_mlflow.db.xz"
}

run_passkey() {  # issue 48.2: the passkey recipe trained and evaluated, NSA and/or the dense twin
  local a run dir args ev=(--lengths 32768 --passkey-lengths 4096 8192 16384 32768 --trials "${PASSKEY_TRIALS:-16}"
    --device cuda --dtype bf16 --overwrite)
  ray_bundle; [ -n "${DRY_RUN:-}" ] || local_data
  for a in ${*:-nsa dense}; do
    run=passkey-$a dir=$GPU_WORK/passkey/passkey-$a
    args=(--config pipelines/configs/passkey.yaml "model.attention=$a" "logging.name=$run" "logging.root=$GPU_WORK/passkey"
          "data.path=$PWD/data/offline_python" "logging.mlflow=$MLFLOW" ${PASSKEY_EXTRA:-})   # PASSKEY_EXTRA: a CPU trial
    if [ -n "${DRY_RUN:-}" ]; then   # the config resolves; the evaluation's flags are printed, not run
      python3 pipelines/train.py --print-config "${args[@]}" || return; echo "evaluate $a: ${ev[*]}"; continue
    fi
    # a fresh run (one left by an earlier call on this warm machine would be resumed by name), unless PASSKEY_KEEP;
    # a halt file an earlier call left would stop this one at its first step
    [ -n "${PASSKEY_KEEP:-}" ] || rm -rf "$dir"
    rm -f "$dir/.HALT"
    local halter=
    if [ -n "${PASSKEY_HALT_S:-}" ]; then   # the loop checkpoints and stops when it sees the file (every log step)
      ( sleep "$PASSKEY_HALT_S"; mkdir -p "$dir"
        echo "bench/gpu.sh: this call's time (PASSKEY_HALT_S=$PASSKEY_HALT_S)" > "$dir/.HALT" ) & halter=$!
    fi
    timeout --foreground -k 60 "${T_PASSKEY:-$(( T_RUN - 120 ))}" python3 pipelines/train.py "${args[@]}"
    echo "train $a rc=$?"; cp "$dir/metrics.json" "$OUT/passkey_${a}_train.json"
    [ -z "$halter" ] || kill "$halter" 2>/dev/null
    [ "${PASSKEY_EVAL:-1}" != 0 ] || continue
    timeout 110 python3 pipelines/evaluate.py --checkpoint "$dir" "${ev[@]}" --out "$dir/eval" \
      $([ "$MLFLOW" = true ] || echo --no-mlflow) || return
    cp "$(ls "$dir"/eval/eval_step_*.json | tail -1)" "$OUT/passkey_$a.json"
    cp "$(ls "$dir"/eval/passkey_step_*.png | tail -1)" "$OUT/passkey_$a.png"
  done
}

on_gpus() {  # NAME FN ARGS...: a Ray-route subcommand with its log in $OUT/NAME.log (one of its two files)
  local name=$1 fn=$2; shift 2
  RUN_NAME=$name
  mkdir -p "$GPU_WORK"
  { [ -n "${DRY_RUN:-}" ] || ! command -v nvidia-smi >/dev/null || nvidia-smi -L; "$fn" "$@"; echo "$name rc=$?"; } 2>&1 | tee "$OUT/$name.log" \
    | grep -vE "Warning|warn|Dataset|Progress bars|core_worker" | tail -40
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  bundle-fa4) bundle_fa4; exit ;;
  bundle-ray) bundle_ray; exit ;;
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
  job) on_gpus job run_job ;;
  scale) on_gpus "scale${1:+_$(IFS=_; echo "$*")}" run_scale "$@" ;;   # e.g. scale_65536.json: calls do not clash
  heal) on_gpus heal run_heal ;;
  past-one) on_gpus past_one run_past_one ;;
  lanes-gpu) on_gpus lanes run_lanes_gpu "$@" ;;
  passkey) on_gpus "passkey${1:+_$(IFS=_; echo "$*")}" run_passkey "$@" ;;   # passkey_nsa.log: calls do not clash
  all) gpu_info; run_tests; run_attention; run_decode ;;
  env) peers >&2; echo "export PYTHONPATH=\"$PYTHONPATH\"" ;;
  -h|--help|help|"") awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" ;;
  *) echo "bench/gpu.sh: unknown command '$cmd' (bash bench/gpu.sh --help lists them)" >&2; exit 2 ;;
esac
