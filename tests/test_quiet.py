"""Quiet by default (nsa/telemetry/quiet.py): Ray's routine background-thread errors and the local
PreemptionWatcher's error line stay off stderr unless logging.verbose=true; genuine errors still show."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from conftest import REPO
from nsa.telemetry import quiet

MULTI = "Found multiple active Ray instances: {'a', 'b'}. Please specify the one to connect to"


def _raise_in_thread(name, exc):
    def boom():
        raise exc
    t = threading.Thread(target=boom, name=name)
    t.start()
    t.join()


@pytest.fixture
def restore_hook(monkeypatch):
    # Python's own hook (prints to stderr) instead of pytest's (turns thread errors into warnings)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    monkeypatch.setattr(quiet, "_previous_hook", None)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)


def test_routine_thread_error_hidden_genuine_shown(restore_hook, capfd):
    quiet.quiet_ray(False, local=True)
    assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
    _raise_in_thread("PlacementGroupCleanerMonitor", ConnectionError(MULTI))
    assert capfd.readouterr().err == ""
    _raise_in_thread("PlacementGroupCleanerMonitor", RuntimeError("real trouble"))   # not the routine one
    _raise_in_thread("other", ConnectionError(MULTI))
    err = capfd.readouterr().err
    assert "RuntimeError: real trouble" in err and err.count("multiple active Ray instances") == 1


def test_verbose_shows_everything(restore_hook, capfd):
    quiet.quiet_ray(True, local=True)
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
    _raise_in_thread("PlacementGroupCleanerMonitor", ConnectionError(MULTI))
    assert "multiple active Ray instances" in capfd.readouterr().err


def test_cluster_keeps_the_preemption_watcher(restore_hook):
    quiet.quiet_ray(False, local=False)
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ


@pytest.mark.ray
def test_tiny_run_stderr_is_quiet_and_a_crash_still_shows(tiny_data, tmp_path):
    """A real launch (its own local Ray, so a second instance may exist beside the session's): rank 0
    crashes at step 3 (runtime.fault=crash@3, no retries); the crash reaches the terminal, the noise does not."""
    args = [sys.executable, str(REPO / "pipelines" / "train.py"), "--config",
            str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml"), f"data.path={tiny_data}",
            f"logging.root={tmp_path}", "logging.mlflow=false", "logging.tensorboard=false", "train.seq_len=64",
            "train.steps=4", "runtime.fault=crash@3", "runtime.max_failures=0"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode != 0, p.stdout[-2000:]
    assert "injected crash at step 3" in p.stdout + p.stderr
    for noise in ("PreemptionWatcher", "multiple active Ray instances", "Exception in thread PlacementGroupCleaner"):
        assert noise not in p.stderr, p.stderr[-3000:]


# ------------------------------------------------------------------ a running cluster (ray job submit)
WATCHER_LINE = ("[2026-01-01 00:00:00,000 E 1 1] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' "
                "and ID: 'd7d7' has constructor arguments in the object store and max_restarts > 0. If the ...")


def _job_config(monkeypatch, runtime_env):
    import json
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps({"runtime_env": runtime_env, "metadata": {}}))


def test_cluster_runtime_env_gives_every_process_the_job_address(monkeypatch):
    """The driver's runtime env merges with the one `ray job submit` injects (Ray refuses conflicts) and names
    the job's GCS address, so Ray Train's helper actors never auto-detect among the machine's instances."""
    from ray.runtime_env.runtime_env import _merge_runtime_env
    job = {"working_dir": "gcs://_ray_pkg_x.zip", "env_vars": {"HF_TOKEN": "t"}}
    _job_config(monkeypatch, job)
    env = quiet.cluster_runtime_env("10.1.2.3:6379", verbose=False)
    assert env == {"env_vars": {"RAY_ADDRESS": "10.1.2.3:6379"},
                   "worker_process_setup_hook": "nsa.telemetry.quiet.install_thread_filter"}
    merged = _merge_runtime_env(job, env)
    assert merged is not None and merged["env_vars"] == {"HF_TOKEN": "t", "RAY_ADDRESS": "10.1.2.3:6379"}
    assert quiet.cluster_runtime_env("10.1.2.3:6379", verbose=True) == {"env_vars": {"RAY_ADDRESS": "10.1.2.3:6379"}}
    for other in ("auto", "local", "ray://head:10001", "http://127.0.0.1:8265"):   # not a GCS address
        assert "env_vars" not in quiet.cluster_runtime_env(other, verbose=False), other
    # what the job already sets is left to it, so the merge still succeeds
    job = {"env_vars": {"RAY_ADDRESS": "10.9.9.9:6379"}, "worker_process_setup_hook": "mine.hook"}
    _job_config(monkeypatch, job)
    env = quiet.cluster_runtime_env("10.1.2.3:6379", verbose=False)
    assert env == {} and _merge_runtime_env(job, env) is not None


def test_worker_log_filter_drops_only_the_routine_lines(monkeypatch):
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    printed = []
    monkeypatch.setattr(dispatcher, "handlers", [("ray_print_logs", printed.append), ("other", lambda d: None)])
    assert quiet.filter_worker_logs() and quiet.filter_worker_logs()        # idempotent: wrapped once
    batch = {"pid": 7, "is_err": True, "lines": [WATCHER_LINE, "RuntimeError: real trouble"]}
    dispatcher.emit(batch)
    dispatcher.emit({"pid": 7, "is_err": True, "lines": [WATCHER_LINE]})   # nothing left: nothing printed
    dispatcher.emit({"pid": 8, "is_err": False, "lines": ["step 1 loss 5.5"]})
    assert [d["lines"] for d in printed] == [["RuntimeError: real trouble"], ["step 1 loss 5.5"]]
    assert batch["lines"][0] == WATCHER_LINE                                 # the caller's batch untouched
    # another actor's same warning is not Ray Train's watcher: shown
    other = WATCHER_LINE.replace("PreemptionWatcher", "MyActor")
    dispatcher.emit({"pid": 9, "is_err": True, "lines": [other]})
    assert printed[-1]["lines"] == [other]


@pytest.mark.ray
def test_watcher_line_off_the_driver_output(ray_session, monkeypatch, capfd):
    """Ray's real warning, made the way Train makes it (a restartable actor named PreemptionWatcher created
    from another actor with an object-store argument), does not reach the driver's stderr; a line the
    same worker prints afterwards does."""
    import numpy as np
    import ray
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    monkeypatch.setattr(dispatcher, "handlers", list(dispatcher.handlers))   # unwrapped again afterwards
    assert quiet.filter_worker_logs()

    @ray.remote(num_cpus=0)
    class Controller:
        def start(self, arg):
            @ray.remote(num_cpus=0, max_restarts=-1)
            class PreemptionWatcher:
                def __init__(self, a):
                    self.n = len(a)

                def ping(self):
                    return self.n
            self.w = PreemptionWatcher.remote(arg)
            n = ray.get(self.w.ping.remote())
            print("after-the-watcher-marker", file=sys.stderr, flush=True)
            return n

    c = Controller.remote()
    assert ray.get(c.start.remote(np.zeros(200_000))) == 200_000
    import time
    err, deadline = "", time.time() + 30
    while "after-the-watcher-marker" not in err and time.time() < deadline:
        time.sleep(0.5)
        err += capfd.readouterr().err
    assert "after-the-watcher-marker" in err
    assert "has constructor arguments" not in err, err[-2000:]
    ray.kill(c)
