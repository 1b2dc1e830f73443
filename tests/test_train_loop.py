"""The worker loop without Ray (nsa.train.local_env.LocalEnv): control, faults, heartbeats, resume.

Seconds each: a 1-layer model on 64-token rows, one process."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import threading

import pytest

from conftest import local_cfg, run_local
from nsa.telemetry import read_heartbeat
from nsa.train.checkpoint import list_checkpoints


_cfg, _run = local_cfg, run_local


def _hb(run_dir):
    return read_heartbeat(os.path.join(run_dir, "heartbeat_rank0.jsonl"))


def _csv(run_dir, name="training.csv"):
    with open(os.path.join(run_dir, name), newline="") as fh:
        return list(csv.DictReader(fh))


def test_heartbeat_sequence_and_artifacts(tiny_data, tmp_path):
    s, rd = _run(_cfg(tiny_data, tmp_path, train__eval_every=4, logging__stats_every=3))
    assert s["status"] == "completed" and s["step"] == 8 and s["checkpoints"] == [8]
    hb = _hb(rd)
    kinds = [(r["kind"], r["step"]) for r in hb]
    # the runbook's acceptance: step 1 progress + step_end, then step 2 step_start, in this order
    i = kinds.index(("progress", 1))
    assert kinds.index(("step_end", 1)) > i and kinds.index(("step_start", 2)) > kinds.index(("step_end", 1))
    end = next(r for r in hb if r["kind"] == "step_end" and r["step"] == 4)
    for field in ("loss", "lr", "grad_norm", "step_ms", "fetch_ms", "step_ms_p95", "fetch_ms_p50", "rss_mib",
                  "fallbacks"):
        assert field in end, field
    # no NaN placeholder: a loss in a heartbeat is a measured one, and says which step it was read at
    progress = [r for r in hb if r["kind"] == "progress" and "stats" not in r]
    assert "loss" not in progress[0] and progress[0]["step"] == 1
    assert all(math.isfinite(r["loss"]) and r["loss_step"] < r["step"] for r in progress[1:])
    step_end = {r["step"]: r for r in hb if r["kind"] == "step_end"}
    assert progress[1]["loss"] == step_end[1]["loss"] and step_end[1]["loss_step"] == 1
    assert all(math.isfinite(r["loss"]) and r["loss_step"] <= r["step"] for r in step_end.values())
    stats = [r for r in hb if r["kind"] == "progress" and "stats" in r]
    assert [r["step"] for r in stats] == [3, 6]
    assert 0.0 < stats[0]["stats"]["gate/L0/entropy"] <= math.log(3) + 1e-6
    rows = _csv(rd)
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert float(rows[3]["lr"]) == pytest.approx(cfg_lr(rd, 4))       # lr logged is the one the step used
    assert [r["step"] for r in _csv(rd, "val.csv")] == ["4", "8"]
    for f in ("metrics.json", "env.json", "training.png"):
        assert os.path.isfile(os.path.join(rd, f)), f
    env = json.loads(open(os.path.join(rd, "env.json")).read())
    assert "torch" in env["versions"] and "kernel_policy" in env


def cfg_lr(run_dir, step):
    from nsa.train.schedule import lr_factor
    cfg = json.loads(open(os.path.join(run_dir, "metrics.json")).read())
    assert cfg["total_steps"] == 8
    return 3e-3 * lr_factor(step - 1, 5, 8, 0.1)


@pytest.mark.parametrize("policy", ["halt", "skip"])
def test_nonfinite_policy(tiny_data, tmp_path, policy):
    s, rd = _run(_cfg(tiny_data, tmp_path, runtime__fault="nan@3", train__on_nonfinite=policy))
    anomalies = [r for r in _hb(rd) if r["kind"] == "anomaly"]
    assert anomalies and anomalies[0]["step"] == 3
    if policy == "halt":
        assert s["status"] == "anomaly" and s["step"] == 3 and s["checkpoints"] == []   # no poisoned save
        assert any(r["kind"] == "halt" and r["status"] == "anomaly" for r in _hb(rd))
    else:
        assert s["status"] == "completed" and s["step"] == 8 and s["nonfinite_steps"] == 1
        assert math.isfinite(s["final_loss"])                   # the skipped update left weights intact


def test_halt_file_checkpoints_and_resume_continues(tiny_data, tmp_path):
    s, rd = _run(_cfg(tiny_data, tmp_path, runtime__fault="halt@3"))
    assert s["status"] == "halted" and s["step"] == 3 and s["checkpoints"] == [3]
    assert ".HALT" in s["reason"]
    first = (tmp_path / "r" / "checkpoint_00000003" / "checkpoint.pt").read_bytes()
    os.remove(os.path.join(rd, ".HALT"))
    s2, _ = _run(_cfg(tiny_data, tmp_path, runtime__fault="halt@3"))   # marker: the fault fires once
    assert s2["status"] == "completed" and s2["start_step"] == 3 and s2["step"] == 8
    assert (tmp_path / "r" / "checkpoint_00000003" / "checkpoint.pt").read_bytes() == first  # not rewritten
    assert [int(r["step"]) for r in _csv(rd)] == list(range(1, 9))   # nothing lost, nothing doubled


# test_exact_resume_matches_uninterrupted: in tests/test_seek_resume.py (resume seeks to the data position)


def test_sigusr2_requests_checkpoint_and_sigterm_stops(tiny_data, tmp_path):
    cfg = _cfg(tiny_data, tmp_path, train__steps=40)
    rd = tmp_path / "r"
    sent = []

    def poke():   # wait until the loop runs (its signal capture is installed), then signal ourselves
        hb = rd / "heartbeat_rank0.jsonl"
        for _ in range(600):
            if hb.exists() and '"step":3' in hb.read_text() and not sent:
                os.kill(os.getpid(), signal.SIGUSR2)
                sent.append("usr2")
            if sent == ["usr2"] and '"kind":"checkpoint"' in hb.read_text():
                os.kill(os.getpid(), signal.SIGTERM)
                sent.append("term")
                return
            threading.Event().wait(0.05)

    th = threading.Thread(target=poke, daemon=True)
    th.start()
    s, _ = _run(cfg)
    th.join(5)
    assert sent == ["usr2", "term"]
    assert s["status"] == "terminated" and s["reason"] == "SIGTERM" and s["step"] < 40
    reasons = [r["reason"] for r in _hb(rd) if r["kind"] == "checkpoint"]
    assert reasons == ["request", "terminate"]                 # SIGUSR2 save, then the save on SIGTERM
    assert [c for c, _ in list_checkpoints(rd)] == s["checkpoints"]
    assert signal.getsignal(signal.SIGTERM) is not None         # handlers restored after the loop


def test_watchdog_records_injected_stall(tiny_data, tmp_path):
    s, rd = _run(_cfg(tiny_data, tmp_path, runtime__fault="stall@3", train__stall_seconds=1.5, train__steps=4))
    assert s["status"] == "completed" and s["stalls"] >= 1        # a loaded CI box may add a slow step
    stall = [r for r in _hb(rd) if r["kind"] == "stall" and r["step"] == 2]   # stuck before step 3
    assert len(stall) == 1 and os.path.isfile(stall[0]["stack_dump"])
    assert "before_step" in open(stall[0]["stack_dump"]).read()     # the dump shows where it hung
