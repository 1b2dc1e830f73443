#!/usr/bin/env bash
# A local Ray head with the dashboard/job API, for `ray job submit` on one machine, and a stop that ends
# exactly this head (plain `ray stop` ends every Ray process on the machine, other users' included).
#
#   bash cluster/scripts/local_head.sh start [--storage DIR] [--dashboard-port P] [-- ray start options]
#   bash cluster/scripts/local_head.sh status
#   bash cluster/scripts/local_head.sh stop
#
# start: `ray start --head --block` in its own session (setsid), dashboard on 127.0.0.1:P (default 8265),
#   Ray's temp dir $NSA_HEAD_DIR/ray (default /tmp/nsa-head), every other Ray port picked free so that it
#   does not clash with another Ray instance on the machine; pid in $NSA_HEAD_DIR/head.pid, log in
#   $NSA_HEAD_DIR/head.log. The head's environment carries NSA_STORAGE_ROOT=DIR (default: this checkout),
#   so jobs write runs, MLflow and data under DIR, never into Ray's working-dir copy (the cluster nodes do
#   the same with /mnt/shared). Waits until the job API answers, then prints the RAY_ADDRESS to export.
# stop: SIGTERM to that `ray start` (it stops the processes it started), then SIGKILL to whatever is left
#   of this head: processes of its session (process group) or naming its temp dir. Nothing else is touched.
# Options after `--` go to `ray start` (e.g. -- --num-cpus=4 --num-gpus=0).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HEAD_DIR="${NSA_HEAD_DIR:-/tmp/nsa-head}"   # short: Ray's unix socket paths under it are length-limited
RAY_TMP="$HEAD_DIR/ray"
PID_FILE="$HEAD_DIR/head.pid"
LOG_FILE="$HEAD_DIR/head.log"
URL_FILE="$HEAD_DIR/address"

die() {
  echo "error: $*" >&2
  exit 2
}

ray_bin() {
  local py_dir
  py_dir="$(dirname "$(command -v python)")"
  if [[ -x "$py_dir/ray" ]]; then echo "$py_dir/ray"; else command -v ray || die "the ray CLI is not installed"; fi
}

# this head's `ray start` pid, if it is alive and still the process we started (pids are reused)
head_pid() {
  [[ -f "$PID_FILE" ]] || return 1
  local pid
  pid="$(cat "$PID_FILE")"
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "--temp-dir=$RAY_TMP" || return 1
  echo "$pid"
}

free_ports() {   # N distinct free ports, one per line (held open together so that they differ)
  python -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print("\n".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

answers() {   # the job API is up
  python - "$1" <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(f"{sys.argv[1]}/api/version", timeout=2)
except OSError:
    sys.exit(1)
PY
}

# pids of what is left of this head: its session's process group, and Ray processes naming its temp dir
leftovers() {
  local pgid="$1"
  # the path travels in the environment: on awk's own command line it would match awk itself
  ps -ww -eo pid=,pgid=,args= | G="$pgid" D="$RAY_TMP/" S="$$" awk \
    '$1 != ENVIRON["S"] && (($2 == ENVIRON["G"] && ENVIRON["G"] != "") || index($0, ENVIRON["D"]) > 0) {print $1}'
}

start() {
  local storage="$REPO_ROOT" dash=8265 extra=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --storage) storage="${2:?--storage needs a directory}"; shift 2 ;;
      --dashboard-port) dash="${2:?--dashboard-port needs a port}"; shift 2 ;;
      --) shift; extra=("$@"); break ;;
      *) die "unknown option '$1' (see: sed -n 2,17p $0)" ;;
    esac
  done
  if pid="$(head_pid)"; then
    echo "local head already running (pid $pid): export RAY_ADDRESS=$(cat "$URL_FILE")"
    return 0
  fi
  [[ -d "$storage" ]] || die "--storage $storage is not a directory (create it first)"
  storage="$(cd "$storage" && pwd)"
  mkdir -p "$HEAD_DIR"
  local url="http://127.0.0.1:$dash" ray
  ! answers "$url" || die "something already answers on $url: pass --dashboard-port <free port>"
  ray="$(ray_bin)"
  # a port picked free can be taken before Ray binds it: the head then exits at once and we retry
  for attempt in 1 2 3; do
    local ports=() names=(port dashboard-agent-listen-port dashboard-agent-grpc-port runtime-env-agent-port
      ray-client-server-port metrics-export-port node-manager-port object-manager-port) picked
    mapfile -t picked < <(free_ports "${#names[@]}")
    for i in "${!names[@]}"; do ports+=("--${names[$i]}=${picked[$i]}"); done
    # RAY_AUTH_MODE=disabled: a private single-machine head (the job API listens on 127.0.0.1 only)
    env -u RAY_ADDRESS RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" NSA_STORAGE_ROOT="$storage" \
      setsid nohup "$ray" start --head --block --dashboard-host=127.0.0.1 --dashboard-port="$dash" \
      --temp-dir="$RAY_TMP" --disable-usage-stats "${ports[@]}" "${extra[@]}" \
      > "$LOG_FILE" 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" > "$PID_FILE"
    echo "$url" > "$URL_FILE"
    for _ in $(seq 1 180); do
      if answers "$url"; then
        echo "local head up (pid $pid, log $LOG_FILE); jobs keep results under NSA_STORAGE_ROOT=$storage"
        echo "  export RAY_ADDRESS=$url"
        echo "  bash cluster/scripts/local_head.sh stop      # stops this head only"
        return 0
      fi
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
      stop >/dev/null
      die "the head did not answer on $url within 180 s; see $LOG_FILE"
    fi
    echo "head exited at start (attempt $attempt); retrying on other ports" >&2
  done
  tail -n 20 "$LOG_FILE" >&2
  die "the head did not start; see $LOG_FILE"
}

stop() {
  local pid pgid left
  if ! pid="$(head_pid)"; then
    left="$(leftovers "")"
    if [[ -z "$left" ]]; then
      echo "no local head running (no live pid in $PID_FILE)"
      rm -f "$PID_FILE" "$URL_FILE"
      return 0
    fi
    pgid=""
  else
    pgid="$(ps -o pgid= -p "$pid" | tr -d ' ')"
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  fi
  for _ in $(seq 1 10); do
    left="$(leftovers "$pgid")"
    [[ -z "$left" ]] && break
    # shellcheck disable=SC2086
    kill -KILL $left 2>/dev/null || true
    sleep 1
  done
  rm -f "$PID_FILE" "$URL_FILE"
  echo "stopped the local head${pid:+ (pid $pid)}; Ray's files stay in $RAY_TMP"
}

status() {
  if pid="$(head_pid)"; then
    echo "local head running (pid $pid): export RAY_ADDRESS=$(cat "$URL_FILE")"
  else
    echo "no local head running"
    return 1
  fi
}

cmd="${1:-status}"
[[ $# -gt 0 ]] && shift
case "$cmd" in
  start) start "$@" ;;
  stop) stop ;;
  status) status ;;
  *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
