#!/usr/bin/env bash
# Submit the 50k-step production run (or any pipeline) to the running cluster as a Ray job.
#
#   bash cluster/scripts/submit.sh <run-name> <gpus> [section.key=value ...]
#   PIPELINE=pipelines/train.py bash cluster/scripts/submit.sh tiny-gpu 8 runtime.use_gpu=true train.steps=200
#
# Runs here (laptop / CI box with the repo), talks to the job API at $RAY_API (open the tunnel first:
# `ray dashboard ray_cluster.yaml`, or `kubectl port-forward svc/<cluster>-head-svc 8265:8265`).
# The job: with_gpus.sh asks the autoscaler for <gpus> GPUs and waits, then
#   python $PIPELINE logging.root=$RUNS_ROOT logging.name=<run-name> data.path=$DATA_PATH
#          runtime.num_workers=<gpus> logging.mlflow_uri=$MLFLOW_URI <your overrides>
# Your overrides come last and win; options such as --config must follow every key=value (argparse). Submitting again with the same <run-name> RESUMES that run from its
# last checkpoint (logging.name is the resume key); keep <gpus> the same so the global batch is unchanged.
# MLFLOW_URI defaults to the server on the head (http://<head private ip>:5000, started by ray_cluster.yaml);
# on KubeRay export MLFLOW_URI=http://nsa-mlflow:5000 (cluster/kuberay/mlflow.yaml).
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

[[ $# -ge 2 ]] || { sed -n '2,4p' "$0" >&2; exit 2; }
name="$1"
gpus="$2"
shift 2
check_run_name "$name"
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "<gpus>='$gpus' must be a positive integer (the worker count, one GPU each)"
PIPELINE="${PIPELINE:-pipelines/prod_50k.py}"
[[ -f "$REPO_ROOT/$PIPELINE" ]] || die "$PIPELINE does not exist in $REPO_ROOT"

head_private_ip() {
  # The state API lists nodes with their cluster-internal IP; workers reach MLflow there.
  ray list nodes --address "$RAY_API" --format json --limit 1000 |
    python -c 'import json, sys; print(next(n["node_ip"] for n in json.load(sys.stdin) if n["is_head_node"]))'
}
if [[ -z "${MLFLOW_URI:-}" ]]; then
  ip="$(head_private_ip)" || die "cannot reach the Ray API at $RAY_API (is the dashboard tunnel open?)"
  MLFLOW_URI="http://$ip:${MLFLOW_PORT:-5000}"
fi

cd "$REPO_ROOT"   # --working-dir . uploads this checkout (minus the excludes of cluster/runtime_env.yaml)
submission_id="${name}-$(date +%Y%m%d-%H%M%S)"
ray job submit --address "$RAY_API" --submission-id "$submission_id" --no-wait \
  --runtime-env cluster/runtime_env.yaml --working-dir . \
  -- bash cluster/scripts/with_gpus.sh "$gpus" -- \
  python "$PIPELINE" "logging.root=$RUNS_ROOT" "logging.name=$name" "data.path=$DATA_PATH" \
  "runtime.num_workers=$gpus" "logging.mlflow_uri=$MLFLOW_URI" "$@"

cat <<MSG

submitted $submission_id (run dir $RUNS_ROOT/$name)
  ray job logs --address $RAY_API -f $submission_id     # driver output
  bash cluster/scripts/watch.sh $name                  # heartbeat + health check
  bash cluster/scripts/halt.sh $name                   # checkpoint and stop
MSG
