"""Issue 46, item 8 (last point): a driver killed with SIGKILL takes its private Ray instance along within
seconds, and its workers stop at the next step boundary; a cluster the driver merely joined lives on.
Stand-ins (plain processes marked like an instance's) test the reaper and the workers' check without Ray;
the Ray tests kill a real ``pipelines/train.py`` and a real joining driver."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PIPELINES, REPO, TINY_PROFILE, tiny_overrides
from nsa.config.env import RAY_OWNER_VAR
from nsa.launch.reaper import Instance, Liveness, new_marker, start_reaper, start_ticks, supported

pytestmark = pytest.mark.skipif(not supported(), reason="pidfds and /proc: Linux only")
SLEEP = [sys.executable, "-c", "import time; time.sleep(300)"]


def _until(cond, timeout_s: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


@pytest.fixture()
def procs():
    """Popen factory; whatever is still running at the end is killed."""
    started: list[subprocess.Popen] = []

    def spawn(args, **kw) -> subprocess.Popen:
        started.append(subprocess.Popen(args, **kw))
        return started[-1]
    yield spawn
    for p in started:
        if p.poll() is None:
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------------------ stand-ins
def test_liveness_sees_the_end_a_zombie_and_a_reused_pid(procs):
    p = procs(SLEEP)
    watch = Liveness(new_marker(p.pid))
    assert not watch.gone()
    assert Liveness(f"{p.pid}:{int(start_ticks(p.pid)) + 1}:x").gone()     # that pid is another process now
    p.kill()                                                                 # not reaped yet: a zombie
    assert _until(watch.gone, 10)
    p.wait()
    assert Liveness(f"{p.pid}:{start_ticks(os.getpid())}:x").gone()


def test_a_worker_ends_at_the_step_boundary_once_its_driver_is_gone(procs, tmp_path, monkeypatch):
    import torch
    from nsa.train import control
    driver = procs(SLEEP)
    monkeypatch.setenv(RAY_OWNER_VAR, new_marker(driver.pid))

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)
    monkeypatch.setattr(os, "_exit", exit_)
    ctl = control.Control(tmp_path, 0, 1, torch.device("cpu"))
    try:
        assert not ctl.decide().stop                       # driver alive: an ordinary boundary
        driver.kill()
        driver.wait()
        with pytest.raises(Exited) as e:
            ctl.decide()
        assert e.value.args == (control.EXIT_ORPHANED,)
    finally:
        ctl.close()
    monkeypatch.delenv(RAY_OWNER_VAR)                      # a joined cluster's worker: nothing to watch
    ctl = control.Control(tmp_path, 0, 1, torch.device("cpu"))
    assert ctl.driver is None and not ctl.decide().stop
    ctl.close()


@pytest.mark.parametrize("ends", ["driver", "gcs"])
def test_reaper_ends_the_instance_and_nothing_else(procs, tmp_path, ends):
    session = tmp_path / "session_x"
    (session / "logs").mkdir(parents=True)
    log = session / "logs" / "raylet.out"
    driver, gcs = procs(SLEEP), procs(SLEEP)
    marker = new_marker(driver.pid)
    needle = f"{RAY_OWNER_VAR}={marker}"
    env = {**os.environ, RAY_OWNER_VAR: marker}
    worker = procs(SLEEP, env=env)                                              # inherited the marker
    agent = procs(["bash", "-c", f'exec 3>>"{log}"; exec -a ray::FakeAgent sleep 300'])   # renamed, log open
    tail = procs(["bash", "-c", f'exec 3>>"{log}"; exec sleep 300'])          # a user's tool on that log
    other = procs(SLEEP, env={**os.environ, RAY_OWNER_VAR: new_marker(driver.pid)})   # another instance
    inst = Instance(needle, str(session))
    assert _until(lambda: sorted(inst.members()) == sorted([worker.pid, agent.pid]), 10), inst.members()
    reaper = start_reaper(needle, str(session), [f"{gcs.pid}:{start_ticks(gcs.pid)}"])
    time.sleep(0.5)                     # the reaper is up and waiting; nothing may happen before the end
    assert reaper.poll() is None and worker.poll() is None and agent.poll() is None
    (driver if ends == "driver" else gcs).kill()
    assert reaper.wait(timeout=20) == 0
    assert worker.poll() == agent.poll() == -signal.SIGKILL
    assert tail.poll() is None and other.poll() is None
    assert (driver.poll() is None) == (ends == "gcs")      # a living driver is never the reaper's to end


# ------------------------------------------------------------------------------------------ real Ray
def _step_ends(run_dir: Path) -> int:
    last = 0
    for f in run_dir.glob("heartbeat_rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:              # a line being written
                continue
            if r.get("kind") == "step_end":
                last = max(last, r["step"])
    return last


def _alive(pid: int, created: float) -> bool:
    import psutil
    try:
        p = psutil.Process(pid)
        return p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.ray
def test_sigkilled_driver_takes_its_private_instance_along(procs, tiny_data, tmp_path):
    import psutil
    from nsa.train.checkpoint import checkpoint_problem, list_checkpoints
    run_dir = tmp_path / "k"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop(RAY_OWNER_VAR, None)
    with open(tmp_path / "driver.log", "w") as out:      # the driver keeps its own copy of the descriptor
        driver = procs([sys.executable, str(PIPELINES / "train.py"), "--config", TINY_PROFILE,
                        *tiny_overrides(tiny_data, tmp_path, logging__name="k", model__n_layers=1, model__dim=64,
                                        train__steps=1000, train__save_every=1, train__eval_every=0)],
                       env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    ok = _until(lambda: _step_ends(run_dir) >= 3 or driver.poll() is not None, 240, 0.2)
    assert ok and driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
    tree = {p.pid: (p.create_time(), p.name()) for p in psutil.Process(driver.pid).children(recursive=True)}
    raylet = next(psutil.Process(pid) for pid, (_, name) in tree.items() if name == "raylet")
    session = next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--session_dir="))
    marker = next(e for e in Path(f"/proc/{raylet.pid}/environ").read_bytes().decode().split("\0")
                  if e.startswith(f"{RAY_OWNER_VAR}="))
    assert {"gcs_server", "ray::RayTrainWorker", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= {
        n for _, n in tree.values()}, tree
    at_kill = _step_ends(run_dir)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    inst = Instance(marker, session)

    def left():
        return [tree[p][1] for p in tree if _alive(p, tree[p][0])] + inst.members()
    assert _until(lambda: not left(), 15, 0.1), left()
    assert _step_ends(run_dir) <= at_kill + 1
    steps = [s for s, _ in list_checkpoints(run_dir)]
    assert steps and max(steps) <= at_kill + 1
    assert all(checkpoint_problem(run_dir / f"checkpoint_{s:08d}") is None for s in steps)
    assert "nsa reaper: its driver ended" in (Path(session) / "logs" / "nsa_reaper.log").read_text()


def test_a_joined_cluster_gets_no_marker_and_no_reaper(monkeypatch):
    """``runtime.ray_address`` (``ray job submit`` sets it from RAY_ADDRESS): ray.init joins with the
    environment unmarked and no reaper starts, so the driver's death ends only its own job. A real cluster
    cannot be played by the session's instance: it is loopback-only, which a joining driver cannot reach."""
    import ray
    from nsa.config import resolve_config
    from nsa.launch import builder
    from nsa.train import ray_local
    for name in ("RAY_AUTH_MODE", "RAY_TRAIN_ENABLE_PRINT_PATCH"):     # connect_ray sets them where unset
        monkeypatch.setenv(name, os.environ.get(name, "x"))
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)

    def init(**kw):                 # what Ray would see, and a new node as a started instance leaves behind
        seen.append((kw.get("address"), os.environ.get(RAY_OWNER_VAR)))
        monkeypatch.setattr(ray._private.worker, "_global_node", object())
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray_local, "_start_reaper", lambda needle: seen.append("reaper"))
    cfg, _ = resolve_config(TINY_PROFILE, ["runtime.ray_address=10.0.0.7:6379", "logging.verbose=true"])
    assert builder.connect_ray(cfg) == "ray: connected to 10.0.0.7:6379"
    assert seen == [("10.0.0.7:6379", None)]
    builder.start_local_ray(num_cpus=1)          # the private instance: marked during init, then reaped
    assert seen[1][0] is None and seen[1][1].startswith(f"{os.getpid()}:") and seen[2] == "reaper"
    assert RAY_OWNER_VAR not in os.environ
