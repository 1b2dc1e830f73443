"""`ray job submit --working-dir . -- python pipelines/train.py` against a local `ray start --head` cluster.

The cluster is this test's own (own ports and temp dir) and is stopped by signalling its `ray start --block`
process, never with `ray stop` (which would also stop the session's other Ray instance)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, tiny_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _start_head(tmp: str, env: dict) -> tuple[subprocess.Popen, str, object]:
    """Start `ray start --head --block` on fresh ports; return (process, dashboard url, log file)."""
    port, dash = _free_port(), _free_port()
    # every fixed default port too (dashboard agent 52365, client server 10001, ...): other Ray clusters
    # on the same machine must not make this head's job agent unreachable ("No available agent")
    extra = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "ray-client-server-port", "metrics-export-port", "node-manager-port", "object-manager-port")]
    log = open(Path(tmp) / "head.log", "w")
    proc = subprocess.Popen([_ray_bin(), "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
                             "--dashboard-host=127.0.0.1", "--num-cpus=4", f"--temp-dir={tmp}", "--block",
                             "--disable-usage-stats", *extra], env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{dash}", log


@pytest.fixture()
def head_cluster():
    tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")          # short: unix socket paths are length-limited
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    # the job's driver must get this checkout's nsa (nsa.launch) from --working-dir alone: Ray puts the
    # uploaded copy first on the driver's and workers' PYTHONPATH, so none is inherited from the test run
    env.pop("PYTHONPATH", None)
    # a port picked free can be taken by another process before Ray binds it ("Failed to start the grpc
    # server"): then the head exits at once, and we retry on fresh ports
    for attempt in range(3):
        proc, url, log = _start_head(tmp, env)
        try:
            deadline, up = time.time() + 180, False
            while True:                                        # the job server answers once the head is up
                try:
                    urllib.request.urlopen(f"{url}/api/version", timeout=2)
                    up = True
                    break
                except OSError:
                    if proc.poll() is not None or time.time() > deadline:
                        break
                    time.sleep(1)
            if up:
                break
            if proc.poll() is None:                            # alive but never answered: give up
                proc.kill()
                pytest.fail(f"ray head not answering: {(Path(tmp) / 'head.log').read_text()[-2000:]}")
            if attempt == 2:
                pytest.fail(f"ray head not up: {(Path(tmp) / 'head.log').read_text()[-2000:]}")
        finally:
            if proc.poll() is not None:
                log.close()
    try:
        yield url, env, Path(tmp)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _head_logs(tmp: Path) -> str:
    """Tails of the head's logs, for a failure message."""
    parts = []
    for f in [tmp / "head.log", *sorted((tmp / "session_latest" / "logs").glob("dashboard*.log"))]:
        if f.is_file():
            parts.append(f"\n--- {f.name}\n" + f.read_text(errors="replace")[-800:])
    return "".join(parts)


def test_ray_job_submit_runs_train_py(head_cluster, tiny_data, tmp_path):
    url, env, tmp = head_cluster
    args = tiny_overrides(tiny_data, tmp_path, train__steps=6, logging__name="job", train__save_every=0,
                          train__eval_every=3)
    t0 = time.time()
    for _ in range(20):   # the head's job agent comes up a little after the dashboard answers
        r = subprocess.run([_ray_bin(), "job", "submit", "--address", url, "--working-dir", str(REPO), "--",
                            "python", "pipelines/train.py", *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
        if "No available agent" not in r.stdout + r.stderr:
            break
        time.sleep(2)
    wall = time.time() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:] + _head_logs(tmp)
    assert "ray: connected to" in out                        # RAY_ADDRESS from the job -> no local instance
    assert "== completed at step 6/6" in out and "succeeded" in out
    summary = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    print(f"ray job submit wall time: {wall:.1f}s")
