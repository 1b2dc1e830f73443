"""End-to-end on a local Ray instance (2 CPU workers, gloo DDP, Ray Data, real text), in-process through
pipelines/builder.launch: loss falls, a killed worker is restarted from the last checkpoint, .HALT stops
with a checkpoint and a relaunch by name resumes with the same next loss, one MLflow run per run."""
from __future__ import annotations

import csv
import hashlib
import math

import pytest

from conftest import TINY_PROFILE, tiny_overrides
from nsa.config import resolve_config
from nsa.telemetry import read_heartbeat

pytestmark = pytest.mark.ray

STEPS, SAVE = 40, 20


def _launch(data, root, **kw):
    import builder
    cfg, src = resolve_config(TINY_PROFILE, tiny_overrides(data, root, train__steps=STEPS,
                                                           train__save_every=SAVE, train__eval_every=SAVE, **kw))
    return builder.launch(cfg, src, prefix="e2e")


def _losses(run_dir) -> dict[int, float]:
    with open(run_dir / "training.csv", newline="") as fh:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh)}


@pytest.fixture(scope="module")
def killed_run(ray_session, tiny_data, tmp_path_factory):
    """Run A: rank 1 SIGKILLs itself before step 28 -> Ray restarts the group from checkpoint 20."""
    root = tmp_path_factory.mktemp("e2e_kill")
    out = _launch(tiny_data, root, logging__name="a", runtime__fault="kill@28", runtime__max_failures=2,
                  logging__mlflow=True, logging__tensorboard=True)
    return out


def test_killed_worker_restarts_from_checkpoint_and_completes(killed_run):
    out = killed_run
    assert out.exit_code == 0, out.summary
    s = out.summary
    assert s["status"] == "completed" and s["step"] == STEPS
    assert s["start_step"] == SAVE and s["resumed_from"] == "ray"    # metrics.json of the restarted session
    hb1 = read_heartbeat(out.run_dir / "heartbeat_rank1.jsonl")
    starts = [r for r in hb1 if r["kind"] == "start"]
    assert [r["step"] for r in starts] == [0, SAVE] and starts[0]["pid"] != starts[1]["pid"]
    assert (out.run_dir / ".fault_kill@28.done").exists()


def test_loss_falls_on_real_text(killed_run):
    loss = _losses(killed_run.run_dir)
    assert sorted(loss) == list(range(1, STEPS + 1))               # re-done steps replaced, none doubled
    first = sum(loss[k] for k in range(1, 11)) / 10
    last = sum(loss[k] for k in range(STEPS - 9, STEPS + 1)) / 10
    assert last < first - 0.5, (first, last)
    assert math.isfinite(killed_run.summary["final_val_loss"])


def test_restart_repeats_the_same_losses(killed_run):
    """Steps 21-27 ran twice (before the kill and after the restart from checkpoint 20): same data
    position, weights and optimizer state must give the same losses."""
    by_pid: dict[int, dict[int, float]] = {}
    for r in read_heartbeat(killed_run.run_dir / "heartbeat_rank0.jsonl"):
        if r["kind"] == "step_end" and SAVE < r["step"] < 28:
            by_pid.setdefault(r["pid"], {})[r["step"]] = r["loss"]
    assert len(by_pid) == 2
    before, after = by_pid.values()
    assert sorted(before) == sorted(after) == list(range(SAVE + 1, 28))
    for k in before:
        assert after[k] == pytest.approx(before[k], rel=1e-4, abs=1e-4), k


def test_one_mlflow_run_across_restart(killed_run):
    from mlflow import MlflowClient
    client = MlflowClient(f"sqlite:///{killed_run.run_dir.parent / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nsa-tiny")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "a" and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["train.steps"] == str(STEPS)
    hist = client.get_metric_history(runs[0].info.run_id, "loss")
    assert max(m.step for m in hist) == STEPS
    arts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"config.yaml", "metrics.json", "training.png"} <= arts
    assert list((killed_run.run_dir / "tb").glob("events.out.tfevents*"))


def test_halt_checkpoints_then_resume_by_name_continues(killed_run, tiny_data, tmp_path):
    out = _launch(tiny_data, tmp_path, logging__name="b", runtime__fault="halt@12")
    assert out.exit_code == 0 and out.summary["status"] == "halted" and out.summary["step"] == 12
    ck = out.run_dir / "checkpoint_00000012" / "checkpoint.pt"
    digest = hashlib.sha256(ck.read_bytes()).hexdigest()
    assert any(r["kind"] == "halt" for r in read_heartbeat(out.run_dir / "heartbeat_rank1.jsonl"))
    # relaunch with the same name: the stale .HALT is moved aside, Ray resumes from checkpoint 12
    out2 = _launch(tiny_data, tmp_path, logging__name="b", runtime__fault="halt@12", train__steps=14)
    s = out2.summary
    assert out2.exit_code == 0 and s["status"] == "completed" and s["start_step"] == 12 and s["step"] == 14
    assert hashlib.sha256(ck.read_bytes()).hexdigest() == digest    # the old checkpoint was not touched
    b, a = _losses(out2.run_dir), _losses(killed_run.run_dir)
    assert sorted(b) == list(range(1, 15))                          # nothing lost across the halt
    # same config and data as run A up to step 12 -> the resumed step 13 reproduces A's step 13
    assert b[13] == pytest.approx(a[13], rel=1e-4, abs=1e-4)
