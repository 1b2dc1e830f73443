"""A/B lanes (lanes/ab_grid.py -> nsa/launch/lanes/, lanes/lanes.yaml): the lanes file, lane configs, effective
configs (every lane changes something on both base profiles, duplicates refused before Ray), hang verdicts, the
lane checks, one real Ray Tune grid of the shipped lanes whose trials do something of their own (the baseline, the
deterministic lane's repeat comparison, the prefill check, a crashing lane, skipped lanes) with MLflow runs, the
summary files and the figures, and every other shipped lane trained in process on its resolved config with the
grid's verdict and MLflow params."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nsa.launch.lanes import cli as lanes_cli
from nsa.launch.lanes.checks import prefill_bound, repeat_check
from nsa.launch.lanes.configs import lane_config
from nsa.launch.lanes.effective import effective_config
from nsa.launch.lanes.plan import plan_grid
from nsa.launch.lanes.records import lane_record
from nsa.launch.lanes.resources import size_concurrency
from nsa.launch.lanes.schema import DEFAULT_LANES, Lane, LaneError, fmt_value, load_lanes, select_lanes
from nsa.launch.lanes.watchdog import SILENCE_FLOOR_S, hang_verdict

REPO = Path(__file__).resolve().parents[1]

TINY = str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml")
PROD = str(REPO / "pipelines" / "configs" / "prod_50k.yaml")
RUNBOOK_LANES = ("baseline", "conservative", "torch", "triton", "dense", "dense_flash_off", "fp32", "bf16", "fp16",
                 "deterministic", "prefill", "anomaly", "no_aux_stats", "grad_ckpt", "no_grad_ckpt", "accum2",
                 "sdpa_flash", "memory", "trace")
# lanes the CPU base cannot run, or already is (the baseline is that lane there)
CPU_SKIPPED = {"torch": "already runs", "triton": "needs a GPU", "dense_flash_off": "CUDA only",
               "fp32": "already runs", "fp16": "needs a GPU", "no_grad_ckpt": "already runs",
               "sdpa_flash": "needs a GPU", "memory": "needs a GPU"}
# on the GPU base (no flash-attn package here): auto is triton, bf16 and checkpointing are the profile's own
GPU_SKIPPED = {"triton": "already runs", "bf16": "already runs", "grad_ckpt": "already runs",
               "dense_flash_off": "no flash_attn package"}


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
        cli = {"runtime.use_gpu": "true"} if lane.requires else {}     # fp16 is refused on CPU by the config
        lc = lane_config(TINY, lane, defaults, cli, pinned={"logging.root": str(tmp_path), "logging.name": lane.name})
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


def _plan(base, *extra, lanes=DEFAULT_LANES):
    return plan_grid(lanes_cli.build_parser().parse_args(["--base", base, "--lanes", str(lanes), *extra]),
                     validate=False)


@pytest.mark.parametrize("base, skipped", [(TINY, CPU_SKIPPED), (PROD, GPU_SKIPPED)])
def test_shipped_lanes_each_change_something_on_both_bases(base, skipped):
    """Every default lane resolves to an effective config unlike the baseline's and every other lane's;
    the ones that cannot run on (or already are) the base are skipped with the reason."""
    plan = _plan(base)
    assert {ln.name: why for ln, why in plan.skipped}.keys() == skipped.keys()
    for lane, why in plan.skipped:
        assert skipped[lane.name] in why, (lane.name, why)
    _, lanes = load_lanes(DEFAULT_LANES)
    effs = {lc.lane.name: effective_config(lc.cfg, lc.lane)[0] for lc in plan.lanes}
    assert set(effs) == {ln.name for ln in select_lanes(lanes, None)} - set(skipped)
    names = sorted(effs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert effs[a] != effs[b], (a, b)
    assert all(lc.effective for lc in plan.lanes if lc.lane.name != "baseline")
    by = {lc.lane.name: lc for lc in plan.lanes}
    assert by["deterministic"].effective["runtime.deterministic"] is True
    assert by["deterministic"].effective["lane.repeat"] == 2 and by["prefill"].effective["lane.checks"] == "prefill"
    assert by["dense"].effective["model.attention"] == "dense"
    assert by["trace"].effective == {"logging.trace_steps": 2}
    if "memory" in by:                       # the GPU base: the runbooks' debug lanes change one field each
        assert by["memory"].effective == {"logging.memory_snapshot_steps": 3}
        assert by["sdpa_flash"].effective["model.dense_backend"] == "sdpa_flash"
        assert by["dense"].effective["model.dense_backend"] == "auto"


def test_duplicate_lane_exits_2_before_ray(tmp_path, monkeypatch, capsys):
    """A lane equal to another lane, or to the baseline, after normalisation (backend auto is torch on CPU,
    flash-attn has no effect there) is refused in the driver: exit 2, one line naming both lanes."""
    from nsa.launch import builder

    def no_ray(*a, **k):
        raise AssertionError("Ray was started for a lanes file that must be refused")
    monkeypatch.setattr(builder, "connect_ray", no_ray)
    dup = _write(tmp_path, "lanes:\n  baseline: {why: w}\n  eager: {why: a, overrides: {train.accumulate: 2}}\n"
                           "  slow: {why: b, overrides: {train.accumulate: 2, nsa.allow_flash_attn: false}}\n")
    assert lanes_cli.main(["--lanes", str(dup)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "lanes 'eager' and 'slow'" in err and "train.accumulate" in err, err
    assert "nsa.allow_flash_attn" in err
    same = _write(tmp_path, "lanes:\n  baseline: {why: w}\n  conservative: {why: c, overrides: {nsa.backend: torch}}\n")
    assert lanes_cli.main(["--lanes", str(same)]) == 2
    err = capsys.readouterr().err.strip()
    assert "lane 'conservative' has the same effective config as lane 'baseline'" in err, err
    assert "nsa.backend=torch (baseline's value: auto resolves to torch without CUDA)" in err, err
    twice = _write(tmp_path, "lanes:\n  a: {why: w}\n  a: {why: v, overrides: {train.accumulate: 2}}\n")
    assert lanes_cli.main(["--lanes", str(twice)]) == 2
    assert "'a' is given twice" in capsys.readouterr().err


def test_repeat_check_and_prefill_bound(tmp_path):
    def run(name, losses):
        d = tmp_path / name
        d.mkdir()
        (d / "training.csv").write_text("step,loss\n" + "".join(f"{i + 1},{v!r}\n" for i, v in enumerate(losses)))
        return d
    a, b, c = run("a", [5.5, 5.25, 5.0]), run("b", [5.5, 5.25, 5.0]), run("c", [5.5, 5.25, 5.0 + 1e-7])
    same = repeat_check(a, b)
    assert same["ok"] and same["max_abs_diff"] == 0.0 and same["steps"] == 3
    off = repeat_check(a, c)
    assert not off["ok"] and off["worst_step"] == 3 and "step 3" in off["error"]
    assert not repeat_check(a, tmp_path / "missing")["ok"]
    assert prefill_bound("fp32", 10.0) == pytest.approx(1e-3)           # test_decode's 1e-4, relative
    assert prefill_bound("fp32", 10.0) < prefill_bound("fp16", 10.0) < prefill_bound("bf16", 10.0)
    assert prefill_bound("fp32", 10.0, tf32=True) == prefill_bound("fp16", 10.0)   # TF32 keeps fp16's mantissa


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
    assert all(f"\n  {name} " in r.stdout for name in RUNBOOK_LANES), r.stdout      # --help lists the lanes
    r = run("--print-config")
    assert r.returncode == 0, r.stderr
    assert "== lane fp16: skipped on this base: needs a GPU" in r.stdout
    assert "== lane fp32: skipped on this base: the base already runs this lane: runtime.precision=fp32" in r.stdout
    r = run("--only", "nope")
    assert r.returncode == 2 and r.stderr.startswith("error: unknown lane(s)") and "Traceback" not in r.stderr


@pytest.mark.parametrize("body, match", [
    ("lanes:\n  a: {why: w, overrides: {nsa.bakend: torch}}\n", r"lane 'a'.*nsa.bakend.*did you mean 'backend'"),
    ("lanes:\n  a: {overrides: {}}\n", r"lane 'a'.*'why'"),
    ("lanes:\n  a: {why: w, overrides: {logging.name: z}}\n", r"set by the grid"),
    ("lanes:\n  a/b: {why: w}\n", r"lane name"),
    ("lanes:\n  a: {why: w, max_step: 3}\n", r"unknown fields \['max_step'\]"),
    ("lanes:\n  a: {why: w, requires: [tpu]}\n", r"requires=\['tpu'\] must be a list of \['gpu', 'flash_attn'\]"),
    ("lanes:\n  a: {why: w, repeat: 3}\n", r"repeat=3 must be 1 or 2"),
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
CRASH_LANE = """
  crash:
    why: the worker raises before step 2
    overrides: {runtime.fault: crash@2}
"""
SMALL = ["data.source=synthetic", "train.seq_len=64", "train.batch_size=2", "train.eval_batches=1",
         "train.eval_every=3", "train.warmup_steps=1"]


# The lanes whose trial does more than fit the lane's config (nsa/launch/lanes/tuner.py lane_trial): the repeat
# run, the prefill check, a failure; the baseline as the reference; two lanes skipped for each of the two reasons.
# Every other shipped lane differs from the baseline only in its resolved config, which this grid shows reaching
# the trial and its MLflow run: test_other_shipped_lanes_train_in_process trains each of them on that config.
TUNE_LANES = ("baseline", "deterministic", "prefill", "crash")
TUNE_SKIPPED = ("fp16", "fp32")


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_shipped_lanes_run_through_tune(ray_session, tmp_path, capsys):
    """The shipped lanes.yaml (plus one crashing lane) on the tiny profile, 3 steps each, as one Tune grid of
    TUNE_LANES: every lane completes but the crash, each MLflow run carries its own effective params, the
    deterministic lane's two runs agree step for step, the prefill check ran, skipped lanes say why, the summary
    run holds the figures."""
    lanes = _write(tmp_path, (REPO / "lanes" / "lanes.yaml").read_text() + CRASH_LANE)
    root = tmp_path / "runs"
    only = ["--only", ",".join(TUNE_LANES + TUNE_SKIPPED)]
    args = lanes_cli.build_parser().parse_args(["--lanes", str(lanes), *only, *SMALL, f"logging.root={root}"])
    plan = plan_grid(args)
    assert sorted(lc.lane.name for lc in plan.lanes) == sorted(TUNE_LANES)
    with pytest.raises(LaneError, match=r"--max-concurrent=1000: each lane holds up to 0.26 CPU"):
        size_concurrency(plan, 1000)          # refused before fit(): Ray would wait forever
    assert 1 <= size_concurrency(plan, None) <= 2
    plan.release()                            # plan_grid took its (unnamed) grid's folder lock
    code = lanes_cli.main(["--lanes", str(lanes), *only, "--name", "g1", "--steps", "3", "--stall-seconds", "300",
                           "--hang-grace", "0", *SMALL, f"logging.root={root}"])
    out = capsys.readouterr().out
    assert code == 1, out[-3000:]                       # a lane failed -> non-zero exit
    n = len(plan.lanes)
    assert f"lane 1 of {n}:" in out and f"lane {n} of {n}:" in out and f"({n} of {n} done)" in out
    summary = json.loads((root / "g1" / "lanes_summary.json").read_text())
    md = (root / "g1" / "lanes_summary.md").read_text()
    rec = {r["lane"]: r for r in summary["lanes"]}
    assert set(rec) == {lc.lane.name for lc in plan.lanes} and "crash" in rec
    assert summary["failed"] == ["crash"] and summary["exit_code"] == 1
    crash = rec.pop("crash")
    assert crash["status"] == "FAILED" and "injected crash" in crash["error"], crash
    for name, r in rec.items():
        assert r["status"] == "COMPLETED", (name, r["error"])
        assert r["step"] == r["total_steps"] == 3 and math.isfinite(r["final_loss"]) and r["val_loss"] is not None
        assert r["toks_per_s"] > 0 and r["peak_mem_mib"] > 0 and len(r["loss_curve"]) == 3 and r["stalls"] == []
    assert rec["baseline"]["rank"] is not None and rec["baseline"]["toks_vs_base"] == 1.0
    rep = rec["deterministic"]["checks"]["repeat"]
    assert rep["ok"] and rep["steps"] == 3 and rep["max_abs_diff"] == 0.0, rep      # zero on CPU
    assert Path(rep["run_b"]).name == "deterministic.repeat"
    pre = rec["prefill"]["checks"]["prefill"]
    assert pre["ok"] and pre["tokens"] == 64 and 0.0 <= pre["max_abs_diff"] <= pre["bound"], pre
    assert all(not r["checks"] for n_, r in rec.items() if n_ not in ("deterministic", "prefill"))
    assert {s["lane"] for s in summary["skipped"]} == set(TUNE_SKIPPED)
    assert "| - | fp16 | SKIPPED |" in md and "skipped: needs a GPU" in md and "repeat: max loss diff 0 over 3" in md
    assert "mlflow ui --backend-store-uri" in out and "FAILED crash" in out and "SKIPPED" in out

    from mlflow import MlflowClient
    client = MlflowClient(summary["mlflow_uri"])
    exp = client.get_experiment_by_name(summary["experiment"])
    runs = client.search_runs([exp.experiment_id], filter_string="tags.grid = 'g1'")
    by_lane = {r.data.tags["lane"]: r for r in runs}
    assert sorted(by_lane) == sorted(lc.lane.name for lc in plan.lanes) and len(runs) == n   # no repeat run
    assert by_lane["crash"].info.status == "FAILED" and by_lane["crash"].data.tags["lane_status"] == "FAILED"
    assert by_lane["crash"].data.params["runtime.fault"] == "crash@2"
    assert by_lane["baseline"].data.params["train.steps"] == "3"                  # params = resolved config
    params = {}
    for name, run in by_lane.items():
        assert name == "crash" or run.info.status == "FINISHED", name
        p = {k: v for k, v in run.data.params.items() if k != "logging.name"}
        lc = next(lc for lc in plan.lanes if lc.lane.name == name)
        for key, want in lc.lane.overrides.items():
            assert p[key] in (str(want), fmt_value(want)), (name, key, p[key], want)
        assert (p["lane.repeat"], p["lane.checks"]) == (str(lc.lane.repeat), ",".join(lc.lane.checks) or "-")
        params[name] = p
    names = sorted(params)
    for i, a in enumerate(names):            # each lane's run differs from every other in its params
        for b in names[i + 1:]:
            assert params[a] != params[b], (a, b)
    assert "loss" in by_lane["baseline"].data.metrics and "val_loss" in by_lane["baseline"].data.metrics
    parents = client.search_runs([exp.experiment_id], filter_string="tags.grid_summary = 'g1'")
    assert len(parents) == 1
    parent = parents[0].info.run_id
    assert all(r.data.tags.get("mlflow.parentRunId") == parent for r in runs)
    arts = {a.path for a in client.list_artifacts(parent)}
    assert {"lanes_loss.png", "lanes_toks_per_s.png", "lanes_summary.json", "lanes_summary.md"} <= arts
    assert parents[0].data.metrics["baseline.completed"] == 1.0 and parents[0].data.metrics["crash.completed"] == 0.0



@pytest.mark.timeout(600)
def test_other_shipped_lanes_train_in_process(tiny_data, tmp_path):
    """Every shipped lane that runs on the CPU base and is not in TUNE_LANES (and the baseline, to compare with)
    trains 2 steps on its resolved grid config with the loop the trial runs, in process (LocalEnv: no Ray, real
    text): the grid's verdict (lane_record, MLflow histories) says COMPLETED with every metric, and the lane's
    MLflow run (finalized by the grid's own code) carries its overrides and differs from every other lane's."""
    import torch

    from nsa.launch import builder
    from nsa.launch.lanes.tracking import add_histories, finalize_mlflow
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import run_training
    root = tmp_path / "runs"
    real_text = [o for o in SMALL if not o.startswith("data.source=")] + [f"data.path={tiny_data}"]
    args = lanes_cli.build_parser().parse_args(["--name", "g2", "--steps", "2", *real_text, f"logging.root={root}"])
    plan = plan_grid(args)
    plan.release()                            # the lanes run in process here, each under its own run lock
    assert {ln.name for ln, _ in plan.skipped} == set(CPU_SKIPPED)
    local = [lc for lc in plan.lanes if lc.lane.name == "baseline" or lc.lane.name not in TUNE_LANES]
    names = {lc.lane.name for lc in local}
    assert set(RUNBOOK_LANES) - set(CPU_SKIPPED) - set(TUNE_LANES) <= names and "io_off" in names
    assert names | set(TUNE_LANES) >= {lc.lane.name for lc in plan.lanes}           # every shipped lane runs
    records, anomaly, threads = [], torch.is_anomaly_enabled(), torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for lc in local:
            run_dir = builder.prepare_run(lc.cfg, lc.sources)
            assert run_dir == plan.grid_dir / lc.lane.name
            run_training(lc.cfg, run_dir, LocalEnv(lc.cfg, run_dir), mlflow_uri=plan.mlflow_uri)
            torch.autograd.set_detect_anomaly(anomaly)        # the anomaly lane turns it on process-wide
            records.append(lane_record(lc.lane.name, lc.lane.why, run_dir, None, 1.0))
    finally:
        torch.autograd.set_detect_anomaly(anomaly)
        torch.set_num_threads(threads)
    finalize_mlflow(plan, records)
    add_histories(plan, records)
    from mlflow import MlflowClient
    client = MlflowClient(plan.mlflow_uri)
    params = {}
    for r, lc in zip(records, local):
        name = lc.lane.name
        assert r["status"] == "COMPLETED", (name, r["error"])
        assert r["step"] == r["total_steps"] == 2 and math.isfinite(r["final_loss"]) and r["val_loss"] is not None
        assert r["toks_per_s"] > 0 and r["peak_mem_mib"] > 0 and len(r["loss_curve"]) == 2 and r["stalls"] == []
        run = client.get_run(r["mlflow_run_id"])
        assert run.info.status == "FINISHED" and run.data.tags["lane"] == name, name
        p = {k: v for k, v in run.data.params.items() if k != "logging.name"}
        assert p["train.steps"] == "2" and p["lane.repeat"] == "1" and p["lane.checks"] == "-"
        for key, want in lc.lane.overrides.items():
            assert p[key] in (str(want), fmt_value(want)), (name, key, p[key], want)
        params[name] = p
        arts = {a.path for a in client.list_artifacts(r["mlflow_run_id"], "debug")}
        # the trace lane's per-module table of its 2 steps, on disk and in its MLflow run; no other lane has one
        assert (arts == {"debug/trace_steps.json", "debug/trace_steps.csv"}) == (name == "trace"), (name, arts)
    trace = json.loads((plan.grid_dir / "trace" / "trace" / "trace_steps.json").read_text())
    assert trace["steps"] == [1, 2] and any(r["module"] == "blocks.0.attn" and r["bwd_ms"] > 0 for r in trace["rows"])
    order = sorted(params)
    for i, a in enumerate(order):            # each lane's run differs from every other in its params
        for b in order[i + 1:]:
            assert params[a] != params[b], (a, b)
