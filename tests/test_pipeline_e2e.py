"""End-to-end on a local Ray instance (2 CPU workers, gloo DDP, Ray Data, real text), in-process through
nsa/launch/builder.launch. Two launches of one run "a" cover the whole lifecycle:

  launch 1: runtime.fault=halt@12  -> .HALT after step 12 -> checkpoint 12, clean stop
  launch 2: same logging.name      -> Ray resumes by name from checkpoint 12; runtime.fault=kill@28 makes
            rank 1 SIGKILL itself before step 28 -> FailureConfig restarts the worker group from
            checkpoint 20 -> the run completes at step 40.
(Exact resume against an uninterrupted run is also checked without Ray in tests/test_train_loop.py.)"""
from __future__ import annotations

import csv
import hashlib
import math

import pytest
import yaml

from conftest import TINY_PROFILE, tiny_overrides
from nsa.config import config_from_dict, resolve_config
from nsa.telemetry import read_heartbeat

pytestmark = pytest.mark.ray

STEPS, SAVE, HALT_AT, KILL_AT = 40, 20, 12, 28


def _launch(data, root, **kw):
    from nsa.launch import builder
    kw = {"train__steps": STEPS, "train__save_every": SAVE, "train__eval_every": SAVE, "logging__name": "a",
          "logging__mlflow": True, "logging__tensorboard": True, **kw}
    cfg, src = resolve_config(TINY_PROFILE, tiny_overrides(data, root, **kw))
    return builder.launch(cfg, src, prefix="e2e")


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def lifecycle(ray_session, tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    halted = _launch(tiny_data, root, runtime__fault=f"halt@{HALT_AT}")
    ck = halted.run_dir / f"checkpoint_{HALT_AT:08d}" / "checkpoint.pt"
    digest = _sha(ck) if ck.exists() else None
    done = _launch(tiny_data, root, runtime__fault=f"kill@{KILL_AT}", runtime__max_failures=2)
    return {"halted": halted, "done": done, "ck12": ck, "digest12": digest}


def _losses(run_dir) -> dict[int, float]:
    with open(run_dir / "training.csv", newline="") as fh:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh)}


def test_halt_file_stops_with_a_checkpoint(lifecycle):
    h = lifecycle["halted"]
    assert h.exit_code == 0 and h.summary["status"] == "halted" and h.summary["step"] == HALT_AT
    assert lifecycle["digest12"] is not None
    for rank in (0, 1):
        hb = read_heartbeat(h.run_dir / f"heartbeat_rank{rank}.jsonl")
        halts = [r for r in hb if r["kind"] == "halt"]
        assert halts and halts[0]["step"] == HALT_AT and halts[0]["checkpoint"] == f"checkpoint_{HALT_AT:08d}"


def test_resume_by_name_then_killed_worker_restarts_and_completes(lifecycle):
    out = lifecycle["done"]
    assert out.exit_code == 0, out.summary
    s = out.summary
    assert s["status"] == "completed" and s["step"] == STEPS
    # metrics.json of the restarted session: from checkpoint 20 (Ray's, or the newer one on disk when the
    # controller had not registered it before the kill: nsa/train/loop.py _resume_state)
    assert s["start_step"] == SAVE and s["resumed_from"] is not None
    recs = read_heartbeat(out.run_dir / "heartbeat_rank1.jsonl")
    starts = [r for r in recs if r["kind"] == "start"]
    assert [r["step"] for r in starts] == [0, HALT_AT, SAVE]         # fresh, resumed by name, restarted
    assert [r["pid"] for r in recs if r["kind"] == "attempt"] == [r["pid"] for r in starts]   # one per attempt
    # both resumes continued at rank 1's recorded data position (shard, row group, offset, carry)
    assert [r.get("data_seek", {}).get("batches_in_epoch") for r in starts] == [None, HALT_AT, SAVE]
    assert len({r["pid"] for r in starts}) == 3
    assert (out.run_dir / f".fault_kill@{KILL_AT}.done").exists()
    assert _sha(lifecycle["ck12"]) == lifecycle["digest12"]           # the old checkpoint was never rewritten


def test_loss_falls_and_no_step_lost_or_doubled(lifecycle):
    loss = _losses(lifecycle["done"].run_dir)
    assert sorted(loss) == list(range(1, STEPS + 1))
    first = sum(loss[k] for k in range(1, 11)) / 10
    last = sum(loss[k] for k in range(STEPS - 9, STEPS + 1)) / 10
    assert last < first - 0.5, (first, last)
    assert math.isfinite(lifecycle["done"].summary["final_val_loss"])


def test_restart_repeats_the_same_losses(lifecycle):
    """Steps 21..27 ran twice (before the kill, and after the restart from checkpoint 20): the same
    weights, optimizer state and data position must give the same losses."""
    by_pid: dict[int, dict[int, float]] = {}
    for r in read_heartbeat(lifecycle["done"].run_dir / "heartbeat_rank0.jsonl"):
        if r["kind"] == "step_end" and SAVE < r["step"] < KILL_AT:
            by_pid.setdefault(r["pid"], {})[r["step"]] = r["loss"]
    assert len(by_pid) == 2
    before, after = by_pid.values()
    assert sorted(before) == sorted(after) == list(range(SAVE + 1, KILL_AT))
    for k in before:
        assert after[k] == pytest.approx(before[k], rel=1e-4, abs=1e-4), k


def test_one_mlflow_run_for_the_whole_lifecycle(lifecycle):
    from mlflow import MlflowClient
    run_dir = lifecycle["done"].run_dir
    client = MlflowClient(f"sqlite:///{run_dir.parent / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nsa-tiny")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "a" and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["train.steps"] == str(STEPS)
    steps = {m.step for m in client.get_metric_history(runs[0].info.run_id, "loss")}
    assert steps == set(range(1, STEPS + 1))
    arts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"config.yaml", "metrics.json", "training.png", "env.json"} <= arts
    assert list((run_dir / "tb").glob("events.out.tfevents*"))


def test_bench_ray_row_from_the_run(lifecycle):
    """bench/bench_train.py's Ray row, computed from this real 2-worker run (restart included)."""
    from test_pipeline_bench import load_bench
    bench_train = load_bench("bench_train")
    run_dir = lifecycle["done"].run_dir
    cfg = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    row = bench_train.ray_row(run_dir, cfg, warmup=2)
    assert row["devices"] == 2 and row["tokens_per_step"] == 2 * 8 * 64
    assert row["toks_per_s"] > 0 and 0 < row["step_ms_p50"] <= row["step_ms_p95"]
