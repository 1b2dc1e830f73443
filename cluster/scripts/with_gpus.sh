#!/usr/bin/env bash
# Make the autoscaler provide GPUs BEFORE the training driver starts, run it, then drop the request.
#
#   bash cluster/scripts/with_gpus.sh <gpus> [--timeout S] -- python pipelines/prod_50k.py k=v ...
#   bash cluster/scripts/with_gpus.sh release        # drop a standing request (e.g. after a SIGKILL)
#
# Why: the driver sizes and checks its worker group from the GPUs that are ALIVE when it starts
# (nsa/launch/builder.py: runtime.num_workers=-1 counts them, check_resources fails fast when a fixed
# count does not fit). On a cluster scaled to zero GPU nodes that is 0 and the run is refused. This
# script runs on the head inside the Ray job (RAY_ADDRESS is set there; on a head shell it uses "auto"):
# it calls ray.autoscaler.sdk.request_resources with <gpus> one-GPU bundles, waits until that many GPUs
# are alive, then runs the command. The request is persistent, so it is replaced by an empty one when
# the command ends (also after a `ray job stop`: SIGTERM is ignored here while the driver checkpoints).
# Exit codes: the command's, 3 if the GPUs did not come up in time, 2 for usage errors.
set -uo pipefail

usage() {
  sed -n '2,5p' "$0" >&2
  exit 2
}

# request_gpus N: persistent autoscaler request for N one-GPU bundles (N=0 drops it).
request_gpus() {
  python - "$1" <<'PY'
import os, sys
import ray
from ray.autoscaler.sdk import request_resources

n = int(sys.argv[1])
ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR", log_to_driver=False)
request_resources(bundles=[{"GPU": 1}] * n)
print(f"with_gpus: autoscaler request set to {n} GPU bundle(s)", flush=True)
PY
}

# wait_gpus N TIMEOUT: poll the cluster until N GPUs are alive; exit 3 on timeout.
wait_gpus() {
  python - "$1" "$2" <<'PY'
import os, sys, time
import ray

need, timeout = int(sys.argv[1]), float(sys.argv[2])
ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR", log_to_driver=False)
t0, last = time.time(), -1.0
while True:
    have = sum(n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive"))
    if have >= need:
        print(f"with_gpus: {have:g} GPUs alive (needed {need}) after {time.time() - t0:.0f}s", flush=True)
        sys.exit(0)
    if have != last:
        print(f"with_gpus: {have:g}/{need} GPUs alive, waiting for the autoscaler ...", flush=True)
        last = have
    if time.time() - t0 > timeout:
        print(f"with_gpus: only {have:g}/{need} GPUs after {timeout:.0f}s: check `ray status` on the head "
              "(instance capacity/quota, max_workers in ray_cluster.yaml or maxReplicas in the RayCluster)",
              file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(10)
PY
}

[[ $# -ge 1 ]] || usage
if [[ "$1" == "release" ]]; then
  request_gpus 0
  exit $?
fi
gpus="$1"
shift
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || { echo "error: <gpus>='$gpus' must be a positive integer" >&2; exit 2; }
timeout=1800
if [[ "${1:-}" == "--timeout" ]]; then
  [[ "${2:-}" =~ ^[0-9]+$ ]] || { echo "error: --timeout needs seconds" >&2; exit 2; }
  timeout="$2"
  shift 2
fi
[[ "${1:-}" == "--" ]] || usage
shift
[[ $# -ge 1 ]] || usage

request_gpus "$gpus" || exit 2
if ! wait_gpus "$gpus" "$timeout"; then
  request_gpus 0
  exit 3
fi

# Run the driver as a child (not exec) so the request can be dropped afterwards. `ray job stop` signals
# every process of the job: the driver turns SIGTERM into .HALT; this shell must neither die nor forward
# a second SIGTERM (the driver treats a second one as "abort now").
trap ':' TERM INT
"$@" &
child=$!
rc=0
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break   # wait was interrupted by a trapped signal: keep waiting
done
request_gpus 0 || echo "with_gpus: could not drop the request; run: bash cluster/scripts/with_gpus.sh release" >&2
exit "$rc"
