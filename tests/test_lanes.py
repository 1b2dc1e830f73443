"""A/B lanes (lanes/ab_grid.py -> nsa/launch/lanes/, lanes/lanes.yaml): the lanes file, lane configs, hang
verdicts, and one real Ray Tune grid (a good lane beside a crashing one) with MLflow runs and the summary files."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa.launch.lanes import cli as lanes_cli
from nsa.launch.lanes.configs import lane_config
from nsa.launch.lanes.plan import plan_grid
from nsa.launch.lanes.records import lane_record
from nsa.launch.lanes.resources import size_concurrency
from nsa.launch.lanes.schema import DEFAULT_LANES, Lane, LaneError, load_lanes, select_lanes
from nsa.launch.lanes.watchdog import SILENCE_FLOOR_S, hang_verdict

REPO = Path(__file__).resolve().parents[1]

TINY = str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml")
RUNBOOK_LANES = ("baseline", "conservative", "fast_path", "fp32", "bf16", "deterministic", "anomaly",
                 "no_aux_stats", "grad_ckpt", "accum2")


def _write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "lanes.yaml"
    f.write_text(text)
    return f


# ---------------------------------------------------------------------------------------- no Ray
def test_lanes_yaml_parses_and_every_lane_resolves(tmp_path):
    defaults, lanes = load_lanes(DEFAULT_LANES)
    default_names = [ln.name for ln in select_lanes(lanes, None)]
    assert set(RUNBOOK_LANES) <= set(default_names)
    for lane in lanes.values():
        assert lane.why and len(lane.why.splitlines()) == 1, lane.name
        lc = lane_config(TINY, lane, defaults, {}, pinned={"logging.root": str(tmp_path), "logging.name": lane.name})
        flat = lc.cfg.flat()
        for key, want in lane.overrides.items():
            assert flat[key] == want, (lane.name, key, flat[key], want)
            assert lc.sources[key] == f"lane:{lane.name}"
        assert lc.cfg.runtime.num_workers == 1 and lc.cfg.runtime.max_failures == 0
        assert lc.sources["logging.name"] == "grid"
        if lane.max_steps is None:   # the old stack hung at step 5 in every lane: each lane must get past it
            assert lc.cfg.train.steps > 5, lane.name
        else:
            assert lc.cfg.train.steps == min(lane.max_steps, int(defaults["train.steps"]))
    assert lanes["anomaly"].max_steps and lanes["anomaly"].overrides == {"runtime.detect_anomaly": True}


def test_precedence_cli_over_lane_over_flags(tmp_path):
    lane = Lane("x", "why", {"train.steps": 7, "train.lr": 0.01}, max_steps=4)
    lc = lane_config(TINY, lane, {"train.lr": 0.5}, {"train.lr": "0.02"}, steps=9)
    assert lc.cfg.train.lr == 0.02 and lc.sources["train.lr"] == "cli"
    assert lc.cfg.train.steps == 4 and "max_steps" in lc.sources["train.steps"]      # the lane caps it
    capped = lane_config(TINY, lane, {}, {"train.steps": "12"})                      # key=value is final
    assert capped.cfg.train.steps == 12
    plain = lane_config(TINY, Lane("y", "why", {}), {}, {}, steps=9, stall_seconds=5)
    assert (plain.cfg.train.steps, plain.cfg.train.stall_seconds) == (9, 5.0)
    assert plain.sources["train.steps"] == "flag"


def test_unknown_lane_is_a_clear_error(capsys):
    _, lanes = load_lanes(DEFAULT_LANES)
    with pytest.raises(LaneError, match=r"unknown lane\(s\) \['nope'\]; known lanes: baseline"):
        select_lanes(lanes, ["baseline", "nope"])
    assert lanes_cli.main(["--only", "baseline,nope"]) == 2
    assert "unknown lane(s) ['nope']" in capsys.readouterr().err


def test_entry_point_runs_from_another_directory(tmp_path):
    """`python lanes/ab_grid.py` imports the package by name (no sys.path edits): --help and --list work
    from any working directory, and a bad lane is exit code 2 with one error line."""
    script = str(REPO / "lanes" / "ab_grid.py")
    env = {**os.environ, "PYTHONPATH": str(REPO)}     # this checkout's nsa, as `pip install -e .` would give

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, script, *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)
    r = run("--list")
    assert r.returncode == 0 and "baseline" in r.stdout, r.stderr
    r = run("--help")
    assert r.returncode == 0 and "--max-concurrent" in r.stdout and "Ray Tune grid" in r.stdout, r.stderr
    r = run("--only", "nope")
    assert r.returncode == 2 and r.stderr.startswith("error: unknown lane(s)") and "Traceback" not in r.stderr


@pytest.mark.parametrize("body, match", [
    ("lanes:\n  a: {why: w, overrides: {nsa.bakend: torch}}\n", r"lane 'a'.*nsa.bakend.*did you mean 'backend'"),
    ("lanes:\n  a: {overrides: {}}\n", r"lane 'a'.*'why'"),
    ("lanes:\n  a: {why: w, overrides: {logging.name: z}}\n", r"set by the grid"),
    ("lanes:\n  a/b: {why: w}\n", r"lane name"),
    ("lanes:\n  a: {why: w, max_step: 3}\n", r"unknown fields \['max_step'\]"),
    ("defaults: {train.stepz: 3}\nlanes:\n  a: {why: w}\n", r"defaults.*train.stepz"),
    ("lanes: {}\n", r"non-empty 'lanes:'"),
    ("lanes:\n  a: {why: w: x}\n", r"not valid YAML"),
])
def test_bad_lanes_files_name_the_problem(tmp_path, body, match):
    with pytest.raises(LaneError, match=match):
        load_lanes(_write(tmp_path, body))


def test_overrides_as_list_of_strings(tmp_path):
    _, lanes = load_lanes(_write(tmp_path, "lanes:\n  a: {why: w, overrides: ['train.accumulate=2']}\n"))
    assert lane_config(TINY, lanes["a"], {}, {}).cfg.train.accumulate == 2


def test_hang_verdict_rules():
    hb = lambda kind, ts, step=3: {"kind": kind, "ts": ts, "step": step}  # noqa: E731
    stalled = [hb("step_start", 100.0), hb("stall", 110.0)]
    assert hang_verdict(stalled, grace=5, stall_s=10, since=0, now=114) is None          # still in grace
    assert "stall record" in hang_verdict(stalled, grace=5, stall_s=10, since=0, now=116)
    recovered = stalled + [hb("step_end", 112.0)]
    assert hang_verdict(recovered, grace=5, stall_s=10, since=0, now=130) is None
    assert hang_verdict(stalled, grace=0, stall_s=10, since=0, now=1e6) is None          # disabled
    silent = [hb("step_start", 100.0)]                      # no stall record (e.g. the paused first fetch)
    assert hang_verdict(silent, grace=5, stall_s=10, since=0, now=100 + SILENCE_FLOOR_S - 1) is None
    assert "no heartbeat" in hang_verdict(silent, grace=5, stall_s=10, since=0, now=100 + SILENCE_FLOOR_S + 1)
    assert "the lane started" in hang_verdict([], grace=5, stall_s=10, since=0, now=SILENCE_FLOOR_S + 1)


def test_lane_record_fails_a_completed_lane_with_a_stall(tmp_path):
    (tmp_path / "metrics.json").write_text(json.dumps(
        {"status": "completed", "step": 4, "total_steps": 4, "start_step": 0, "final_loss": 5.0,
         "final_val_loss": None, "tokens_seen_this_session": 4000, "step_ms_p50": 100.0, "toks_per_s": 50.0}))
    ok = lane_record("a", "w", tmp_path, None, 12.0)
    assert ok["status"] == "COMPLETED" and ok["error"] == "" and ok["toks_per_s"] == pytest.approx(10_000.0)
    stall = {"ts": 1.0, "kind": "stall", "step": 2, "rank": 0, "pid": 1, "seconds_since_kick": 3.2,
             "stack_dump": "/x/stackdump.txt"}
    (tmp_path / "heartbeat_rank0.jsonl").write_text(json.dumps(stall) + "\n")
    bad = lane_record("a", "w", tmp_path, None, 12.0)
    assert bad["status"] == "FAILED" and "stalled after step 2" in bad["error"] and "/x/stackdump.txt" in bad["error"]
    assert bad["stalls"][0]["seconds_since_kick"] == 3.2
    assert lane_record("b", "w", tmp_path / "missing", None, None)["status"] == "FAILED"


# ---------------------------------------------------------------------------------------- Ray Tune grid
GRID_LANES = """
defaults:
  runtime.num_workers: 1
  runtime.cpus_per_worker: 0.25
  runtime.max_failures: 0
  train.steps: 3
  train.seq_len: 64
  train.batch_size: 4
  train.eval_batches: 1
  train.warmup_steps: 1
  logging.log_every: 1
  logging.tensorboard: false
lanes:
  good:
    why: nothing changed
    overrides: {}
  crash:
    why: the worker raises before step 2
    overrides: {runtime.fault: crash@2}
"""


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_grid_runs_lanes_reports_failure_and_tags_mlflow(ray_session, tmp_path, capsys):
    lanes = _write(tmp_path, GRID_LANES)
    root = tmp_path / "runs"
    args = lanes_cli.build_parser().parse_args(["--lanes", str(lanes), "data.source=synthetic", f"logging.root={root}"])
    plan = plan_grid(args)
    with pytest.raises(LaneError, match=r"--max-concurrent=1000: each lane holds up to 0.26 CPU"):
        size_concurrency(plan, 1000)          # refused before fit(): Ray would wait forever
    assert 1 <= size_concurrency(plan, None) <= 2
    code = lanes_cli.main(["--lanes", str(lanes), "--name", "g1", "--max-concurrent", "2", "--stall-seconds", "120",
                         "data.source=synthetic", f"logging.root={root}"])
    out = capsys.readouterr().out
    assert code == 1, out[-3000:]                       # a lane failed -> non-zero exit
    summary = json.loads((root / "g1" / "lanes_summary.json").read_text())
    assert (root / "g1" / "lanes_summary.md").is_file()
    rec = {r["lane"]: r for r in summary["lanes"]}
    good, crash = rec["good"], rec["crash"]
    assert good["status"] == "COMPLETED" and (good["step"], good["total_steps"]) == (3, 3), good
    assert math.isfinite(good["final_loss"]) and good["val_loss"] is not None
    assert crash["status"] == "FAILED" and "injected crash" in crash["error"], crash
    assert summary["failed"] == ["crash"] and summary["exit_code"] == 1
    assert "mlflow ui --backend-store-uri" in out and "FAILED crash" in out

    from mlflow import MlflowClient
    client = MlflowClient(summary["mlflow_uri"])
    exp = client.get_experiment_by_name(summary["experiment"])
    runs = client.search_runs([exp.experiment_id], filter_string="tags.grid = 'g1'")
    by_lane = {r.data.tags["lane"]: r for r in runs}
    assert sorted(by_lane) == ["crash", "good"] and len(runs) == 2
    assert by_lane["good"].info.status == "FINISHED" and by_lane["crash"].info.status == "FAILED"
    assert by_lane["good"].data.params["train.steps"] == "3"                  # params = resolved config
    assert by_lane["crash"].data.params["runtime.fault"] == "crash@2"
    assert "loss" in by_lane["good"].data.metrics and "val_loss" in by_lane["good"].data.metrics
    assert by_lane["crash"].data.tags["lane_status"] == "FAILED"
