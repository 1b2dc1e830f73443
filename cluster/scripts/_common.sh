# Sourced by the cluster/scripts/*.sh helpers (not run directly).
#
# Where things are (override by exporting before calling a script):
#   CLUSTER_YAML   Ray cluster launcher config              (default: <repo>/ray_cluster.yaml)
#   KUBE_CLUSTER   RayCluster name: run on its head pod with kubectl instead of `ray exec` (default: unset)
#   KUBE_NS        Kubernetes namespace for KUBE_CLUSTER     (default: current kubectl namespace)
#   RUNS_ROOT      shared run root = logging.root            (default: /mnt/shared/runs)
#   DATA_PATH      shared shard directory = data.path        (default: /mnt/shared/data/fineweb_edu)
#   RAY_API        Ray dashboard / job API address           (default: http://127.0.0.1:8265, the
#                  `ray dashboard ray_cluster.yaml` or `kubectl port-forward` tunnel)
#   REMOTE_REPO    the repository on the nodes               (default: /home/ray/nsa)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER_YAML="${CLUSTER_YAML:-$REPO_ROOT/ray_cluster.yaml}"
RUNS_ROOT="${RUNS_ROOT:-/mnt/shared/runs}"
DATA_PATH="${DATA_PATH:-/mnt/shared/data/fineweb_edu}"
RAY_API="${RAY_API:-http://127.0.0.1:8265}"
KUBE_CLUSTER="${KUBE_CLUSTER:-}"
KUBE_NS="${KUBE_NS:-}"
# Where the repository lives on the cluster nodes (file_mounts in ray_cluster.yaml, COPY in cluster/Dockerfile).
REMOTE_REPO="${REMOTE_REPO:-/home/ray/nsa}"

die() {
  echo "error: $*" >&2
  exit 2
}

# A run name is one directory under RUNS_ROOT (nsa.config: logging.name has no '/').
check_run_name() {
  local name="${1:-}"
  [[ -n "$name" && "$name" != */* && "$name" != .* ]] ||
    die "run name '${name}' must be a non-empty directory name without '/' (it is logging.name)"
}

# on_head CMD: run a shell command on the Ray head (inside its container), repo as working directory.
on_head() {
  local cmd="cd $REMOTE_REPO && $1"
  if [[ -n "$KUBE_CLUSTER" ]]; then
    local ns=() pod
    [[ -n "$KUBE_NS" ]] && ns=(-n "$KUBE_NS")
    pod="$(kubectl "${ns[@]}" get pod -l "ray.io/cluster=$KUBE_CLUSTER,ray.io/node-type=head" -o name | head -n 1)"
    [[ -n "$pod" ]] || die "no head pod with label ray.io/cluster=$KUBE_CLUSTER (KUBE_CLUSTER, KUBE_NS)"
    kubectl "${ns[@]}" exec "$pod" -c ray-head -- bash -lc "$cmd"
  else
    [[ -f "$CLUSTER_YAML" ]] || die "CLUSTER_YAML=$CLUSTER_YAML does not exist"
    ray exec "$CLUSTER_YAML" "$cmd"
  fi
}

# copy_from_head REMOTE LOCAL: copy a file or directory from the head to this machine.
copy_from_head() {
  local remote="$1" local_path="$2"
  if [[ -n "$KUBE_CLUSTER" ]]; then
    local ns=() pod
    [[ -n "$KUBE_NS" ]] && ns=(-n "$KUBE_NS")
    pod="$(kubectl "${ns[@]}" get pod -l "ray.io/cluster=$KUBE_CLUSTER,ray.io/node-type=head" -o name | head -n 1)"
    [[ -n "$pod" ]] || die "no head pod with label ray.io/cluster=$KUBE_CLUSTER"
    kubectl "${ns[@]}" cp -c ray-head "${pod#pod/}:$remote" "$local_path"
  else
    ray rsync-down "$CLUSTER_YAML" "$remote" "$local_path"
  fi
}
