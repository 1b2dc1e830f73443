#!/usr/bin/env bash
# Tear the cluster down (head and all workers). The EFS file system (runs, checkpoints, data, MLflow)
# is NOT deleted: fetch what you need first (fetch.sh); delete the file system in AWS when done.
#
#   bash cluster/scripts/down.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

cd "$REPO_ROOT"
ray down -y "$CLUSTER_YAML" "$@"
echo "cluster down; runs remain on EFS under $RUNS_ROOT"
