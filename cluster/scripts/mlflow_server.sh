#!/usr/bin/env bash
# MLflow tracking server on the Ray head (cluster launcher; on KubeRay use cluster/kuberay/mlflow.yaml).
#
#   bash cluster/scripts/mlflow_server.sh start|stop|status
#
# Why a server: several processes on several hosts log (rank 0 on a GPU node, drivers on the head);
# a SQLite file on NFS written from two hosts is a corruption risk. Here ONE server process (--workers 1)
# owns the SQLite file on EFS and everyone talks HTTP to http://<head private ip>:$MLFLOW_PORT.
# MLflow 3's host check admits private IPs and localhost by default, which covers the cluster and an
# SSH tunnel (`ray attach ray_cluster.yaml -p 5000`). For a database server set MLFLOW_BACKEND_URI
# (e.g. postgresql://user:pw@host/mlflow) in head_start_ray_commands before this script. A VPC outside
# the RFC 1918 ranges needs MLFLOW_SERVER_ALLOWED_HOSTS (read by mlflow itself), e.g. "100.64.*,localhost:*".
set -euo pipefail

MLFLOW_ROOT="${MLFLOW_ROOT:-/mnt/shared/mlflow}"
MLFLOW_PORT="${MLFLOW_PORT:-5000}"
MLFLOW_BACKEND_URI="${MLFLOW_BACKEND_URI:-sqlite:///$MLFLOW_ROOT/mlflow.db}"
PID_FILE="${HOME}/.nsa-mlflow.pid"
LOG_FILE="/tmp/nsa-mlflow.log"

healthy() {
  python - "$MLFLOW_PORT" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=3) as r:
        sys.exit(0 if r.status == 200 else 1)
except OSError:
    sys.exit(1)
PY
}

running_pid() {
  [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null && cat "$PID_FILE"
}

uri() {
  echo "http://$(hostname -I | awk '{print $1}'):$MLFLOW_PORT"
}

start() {
  if pid="$(running_pid)"; then
    echo "mlflow server already running (pid $pid) at $(uri)"
    return 0
  fi
  mkdir -p "$MLFLOW_ROOT/artifacts"
  # setsid + nohup: the server must outlive the `ray up` shell that starts it.
  setsid nohup mlflow server --host 0.0.0.0 --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "$MLFLOW_BACKEND_URI" --artifacts-destination "$MLFLOW_ROOT/artifacts" \
    >"$LOG_FILE" 2>&1 < /dev/null &
  echo $! > "$PID_FILE"
  for _ in $(seq 1 60); do   # ~30 s to become healthy was measured on a small machine (docs/ray.md)
    if healthy; then
      echo "mlflow server up at $(uri) (backend $MLFLOW_BACKEND_URI, log $LOG_FILE)"
      return 0
    fi
    sleep 2
  done
  echo "error: mlflow server not healthy after 120 s; see $LOG_FILE" >&2
  tail -n 20 "$LOG_FILE" >&2 || true
  return 1
}

stop() {
  if pid="$(running_pid)"; then
    # setsid made the server a process-group leader: stop the group (its uvicorn workers too).
    kill -- "-$pid" 2>/dev/null || kill "$pid"
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    rm -f "$PID_FILE"
    echo "stopped mlflow server (pid $pid)"
  else
    echo "mlflow server not running (no live pid in $PID_FILE)"
  fi
}

case "${1:-status}" in
  start) start ;;
  stop) stop ;;
  status)
    if healthy; then echo "mlflow server healthy at $(uri)"; else echo "mlflow server not answering on :$MLFLOW_PORT"; exit 1; fi ;;
  *) sed -n '4p' "$0" >&2; exit 2 ;;
esac
