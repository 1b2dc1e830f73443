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
