#!/usr/bin/env bash
# Progress and health of a run, read on the head from the shared run directory.
#
#   bash cluster/scripts/watch.sh <run-name> [lines]        # last heartbeats + health check, once
#   bash cluster/scripts/watch.sh <run-name> --follow       # tail -f rank 0's heartbeat
#
# The health check is `python -m nsa.telemetry.check <run dir>` (exit 1 on FAIL: stale heartbeat > 180 s,
# gate collapse, fetch p95, stall/anomaly records); extra thresholds: see its --help.
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

[[ $# -ge 1 ]] || { sed -n '2,5p' "$0" >&2; exit 2; }
name="$1"
check_run_name "$name"
run_dir="$RUNS_ROOT/$name"
if [[ "${2:-}" == "--follow" ]]; then
  on_head "tail -n 5 -F $run_dir/heartbeat_rank0.jsonl"
  exit
fi
lines="${2:-5}"
[[ "$lines" =~ ^[0-9]+$ ]] || die "lines='$lines' must be a number (or --follow)"
on_head "ls $run_dir/heartbeat_rank*.jsonl | sed 's|.*/||' | tr '\n' ' '; echo;
  tail -n $lines $run_dir/heartbeat_rank0.jsonl; echo;
  ls -d $run_dir/checkpoint_[0-9]*/ 2>/dev/null | tail -n 2;
  python -m nsa.telemetry.check $run_dir"
