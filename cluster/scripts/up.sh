#!/usr/bin/env bash
# Launch (or update) the cluster of ray_cluster.yaml from the repository root, after checking that the
# placeholders are filled in. Extra arguments go to `ray up` (e.g. --no-config-cache, --restart-only).
#
#   bash cluster/scripts/up.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

if grep -n "REPLACE_ME" "$CLUSTER_YAML" >&2; then
  die "fill in the REPLACE_ME values above in $CLUSTER_YAML (EFS file system id; see cluster/README.md)"
fi
command -v ray >/dev/null || die "the ray CLI is not installed here: pip install 'ray[default]==2.60.0' boto3"

# file_mounts syncs "." -> /home/ray/nsa, so `ray up` must run in the repository root.
cd "$REPO_ROOT"
ray up -y "$CLUSTER_YAML" "$@"
cat <<MSG

next:
  ray dashboard $CLUSTER_YAML            # keep open: tunnels the dashboard/job API to $RAY_API
  bash cluster/scripts/submit.sh <run-name> <gpus>
MSG
