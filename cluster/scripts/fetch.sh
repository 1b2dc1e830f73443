#!/usr/bin/env bash
# Copy a run's latest checkpoint plus its small files (config, CSV, heartbeats, metrics) from shared
# storage to this machine, e.g. for `python pipelines/generate.py --checkpoint <dest>/<checkpoint_...>`.
#
#   bash cluster/scripts/fetch.sh <run-name> [dest]         # dest default: runs/<run-name>
#   bash cluster/scripts/fetch.sh <run-name> [dest] --all   # every kept checkpoint (large)
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

[[ $# -ge 1 ]] || { sed -n '4,5p' "$0" >&2; exit 2; }
name="$1"
check_run_name "$name"
dest="${2:-$REPO_ROOT/runs/$name}"
run_dir="$RUNS_ROOT/$name"
mkdir -p "$dest"

if [[ "${3:-}" == "--all" ]]; then
  copy_from_head "$run_dir/" "$dest/"
  exit
fi
# The head writes the small files and the name of the newest checkpoint into a staging folder on shared
# storage; copying a folder back avoids parsing remote command output. Only checkpoint_<digits>/ folders
# count: Ray Train keeps a checkpoint_manager_snapshot.json file beside them.
stage="$run_dir/.fetch"
on_head "rm -rf $stage && mkdir -p $stage &&
  find $run_dir -maxdepth 1 -type f \( -name '*.yaml' -o -name '*.csv' -o -name '*.json' -o -name '*.jsonl' -o -name '*.txt' \) -exec cp {} $stage/ \; &&
  (ls -d $run_dir/checkpoint_[0-9]*/ 2>/dev/null | sort | tail -n 1 | xargs -r -n 1 basename > $stage/LATEST_CHECKPOINT)"
copy_from_head "$stage/" "$dest/"
latest="$(cat "$dest/LATEST_CHECKPOINT" 2>/dev/null || true)"
if [[ -z "$latest" ]]; then
  echo "no checkpoint yet in $run_dir; fetched the logs into $dest"
  exit 0
fi
copy_from_head "$run_dir/$latest/" "$dest/$latest/"
echo "fetched $latest into $dest/$latest"
echo "  python pipelines/generate.py --checkpoint $dest/$latest --prompt 'Once upon a time'"
