#!/usr/bin/env bash
# Ask a running job to stop cleanly, or to checkpoint now, through its control files on shared storage.
#
#   bash cluster/scripts/halt.sh <run-name> [reason]        # .HALT: checkpoint at the next step, then stop
#   bash cluster/scripts/halt.sh --checkpoint <run-name>    # .CHECKPOINT: checkpoint at the next step, go on
#
# Rank 0 polls the files each step (nsa/train/control.py); the job then ends with status "halted" and
# the same submit (same run name) resumes it. A stale .HALT is moved aside by the next launch.
# Hard stop instead: `ray job stop <submission id>` (SIGTERM -> .HALT; SIGKILL after RAY_JOB_STOP_WAIT_TIME_S).
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

file=.HALT
if [[ "${1:-}" == "--checkpoint" ]]; then
  file=.CHECKPOINT
  shift
fi
[[ $# -ge 1 ]] || { sed -n '2,4p' "$0" >&2; exit 2; }
name="$1"
check_run_name "$name"
reason="${2:-halt: manual_stop by ${USER:-operator}}"
reason="${reason//\'/}"   # it is written through a single-quoted remote command
run_dir="$RUNS_ROOT/$name"
on_head "test -d $run_dir || { echo 'no run dir $run_dir' >&2; exit 2; };
  printf '%s\n' '$reason' > $run_dir/$file && echo 'wrote $run_dir/$file'"
