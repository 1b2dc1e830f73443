"""cluster/scripts/gpu_runs.py, the helper of bench/gpu.sh's Ray-route runs (docs/gpu_runbook.md), on synthetic
heartbeat files: attempts and restart step, the losses of the steps run twice, recovery seconds from a kill, a
stall or an injected fault, a run against a reference, the scaling table, and kill-at on a real process. Then
every config the GPU subcommands launch, resolved on the CPU (DRY_RUN=1)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_runs", REPO / "cluster" / "scripts" / "gpu_runs.py")
gpu_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_runs)


def loss(step: int) -> float:
    return 5.0 - 0.01 * step


def write_run(run_dir: Path, attempts: list[dict], ranks: int = 2) -> None:
    """attempts: {"pid", "start": step, "ts": start time, "steps": (first, last), "loss": fn(step, rank)}; one
    step_end a second after the start per step; rank r's pid is pid + r."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(ranks):
        lines = []
        for a in attempts:
            pid, ts = a["pid"] + rank, a["ts"]
            lines.append({"ts": ts, "kind": "attempt", "step": a["start"], "rank": rank, "pid": pid})
            lines.append({"ts": ts, "kind": "start", "step": a["start"], "rank": rank, "pid": pid})
            for i, s in enumerate(range(a["steps"][0], a["steps"][1] + 1)):
                lines.append({"ts": ts + 1 + i, "kind": "step_end", "step": s, "rank": rank, "pid": pid,
                              "loss": a["loss"](s, rank), "loss_step": s, "cuda_max_alloc_mib": 1024.0 * (rank + 1)})
            for r in a.get("extra", []):
                lines.append({"rank": rank, "pid": pid, **r})
        (run_dir / f"heartbeat_rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def same_losses(s: int, rank: int) -> float:
    return loss(s) + 0.1 * rank


def test_report_of_a_killed_worker_restarted_from_its_checkpoint(tmp_path):
    run = tmp_path / "job"
    write_run(run, [{"pid": 100, "start": 0, "ts": 1000.0, "steps": (1, 27), "loss": same_losses},
                    {"pid": 200, "start": 20, "ts": 1040.0, "steps": (21, 40), "loss": same_losses}])
    ev = tmp_path / "kill.json"
    ev.write_text(json.dumps({"kind": "kill", "rank": 1, "pid": 101, "ts": 1030.0, "step": 27}))
    rep = gpu_runs.report(run, str(ev))
    assert rep["restart_steps"] == [20] and [a["pid"] for a in rep["attempts"]] == [100, 200]
    assert [(r["rank"], r["steps"], r["first"], r["last"], r["same"]) for r in rep["repeated"]] == \
        [(0, 7, 21, 27, True), (1, 7, 21, 27, True)]
    assert rep["repeated_same"] is True
    # restarted at 1040; its first step_end (21) at 1041; step 28, the first past the kill, at 1048
    assert rep["recovery"] == {"restart_step": 20, "to_restart_s": 10.0, "to_first_step_s": 11.0,
                               "to_past_event_step_s": 18.0}
    assert rep["losses"]["40"] == pytest.approx(loss(40) + 0.05)          # mean over the two ranks
    assert rep["peak_mem_gib_per_rank"] == {0: 1.0, 1: 2.0}
    # one repeated step off by 1e-3: not the same losses, and the report names the step
    write_run(run, [{"pid": 100, "start": 0, "ts": 1000.0, "steps": (1, 27), "loss": same_losses},
                    {"pid": 200, "start": 20, "ts": 1040.0, "steps": (21, 40),
                     "loss": lambda s, r: same_losses(s, r) + (1e-3 if s == 24 else 0.0)}])
    rep = gpu_runs.report(run, str(ev))
    assert rep["repeated_same"] is False
    assert {r["worst_step"] for r in rep["repeated"]} == {24}
    assert rep["repeated"][0]["max_abs_diff"] == pytest.approx(1e-3)
    # the kill never fired (no event file): no event, no recovery figures
    rep = gpu_runs.report(run, str(tmp_path / "missing.json"))
    assert rep["event"] is None and "recovery" not in rep


def test_stall_record_is_the_event_and_a_reference_run_is_compared(tmp_path):
    stall = {"ts": 1020.0, "kind": "stall", "step": 9, "seconds_since_kick": 15.0, "exiting": True,
             "action": "restart"}
    write_run(tmp_path / "st", [{"pid": 10, "start": 0, "ts": 1000.0, "steps": (1, 9), "loss": same_losses,
                                 "extra": [stall]},
                                {"pid": 20, "start": 5, "ts": 1030.0, "steps": (6, 12), "loss": same_losses}])
    write_run(tmp_path / "ref", [{"pid": 1, "start": 0, "ts": 500.0, "steps": (1, 12), "loss": same_losses}])
    rep = gpu_runs.report(tmp_path / "st", reference=tmp_path / "ref")
    ev = rep["event"]
    assert (ev["kind"], ev["step"], ev["ts"], ev["detected_ts"]) == ("stall", 9, 1005.0, 1020.0)
    # stall began at 1005 (last kick); restarted at 1030; step 10 (first past 9) ended at 1030 + 5
    assert rep["recovery"] == {"restart_step": 5, "to_restart_s": 25.0, "to_first_step_s": 26.0,
                               "to_past_event_step_s": 30.0}
    assert rep["reference"]["steps"] == 12 and rep["reference"]["same"] is True
    write_run(tmp_path / "ref", [{"pid": 1, "start": 0, "ts": 500.0, "steps": (1, 12),
                                  "loss": lambda s, r: same_losses(s, r) + 0.01 * (s == 11)}])
    ref = gpu_runs.report(tmp_path / "st", reference=tmp_path / "ref")["reference"]
    assert ref["same"] is False and ref["worst_step"] == 11 and ref["max_abs_diff"] == pytest.approx(0.01)


def test_injected_fault_marker_is_the_event(tmp_path):
    run = tmp_path / "f"
    write_run(run, [{"pid": 10, "start": 0, "ts": 1000.0, "steps": (1, 7), "loss": same_losses},
                    {"pid": 20, "start": 4, "ts": 1012.0, "steps": (5, 10), "loss": same_losses}])
    (run / ".fault_kill@8.done").write_text("fired at 1008.5 by rank 1 pid 11\n")
    rep = gpu_runs.report(run)
    assert rep["event"] == {"kind": "fault:kill", "step": 7, "ts": 1008.5}
    assert rep["recovery"]["to_restart_s"] == 3.5 and rep["recovery"]["to_past_event_step_s"] == 7.5


def test_losses_logged_every_n_steps_and_nonfinite_are_left_out(tmp_path):
    recs = [{"ts": 1.0, "kind": "start", "step": 0, "pid": 5},
            {"ts": 2.0, "kind": "step_end", "step": 1, "pid": 5},                                  # before a log
            {"ts": 3.0, "kind": "step_end", "step": 2, "pid": 5, "loss": 3.0, "loss_step": 2},
            {"ts": 4.0, "kind": "step_end", "step": 3, "pid": 5, "loss": 3.0, "loss_step": 2},    # stale value
            {"ts": 5.0, "kind": "step_end", "step": 4, "pid": 5, "loss": float("nan"), "loss_step": 4}]
    (a,) = gpu_runs.attempts(recs)
    assert a["losses"] == {2: 3.0} and sorted(a["ends"]) == [1, 2, 3, 4]
    assert gpu_runs.compare({1: 1.0}, {2: 1.0}) == {"steps": 0, "same": None}


def test_kill_at_sigkills_the_worker_once_its_step_is_done(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        run = tmp_path / "r"
        run.mkdir()
        hb = run / "heartbeat_rank1.jsonl"
        hb.write_text("".join(json.dumps({"ts": time.time(), "kind": "step_end", "step": s, "rank": 1,
                                          "pid": proc.pid}) + "\n" for s in (1, 2)))
        with pytest.raises(TimeoutError, match="did not finish step 3"):
            gpu_runs.kill_at(run, step=3, rank=1, timeout=0.3)
        assert proc.poll() is None                                   # not its step yet: left alone
        with hb.open("a") as fh:
            fh.write(json.dumps({"ts": time.time(), "kind": "step_end", "step": 3, "rank": 1, "pid": proc.pid}) + "\n")
        ev = gpu_runs.kill_at(run, step=3, rank=1, timeout=5)
        assert proc.wait(timeout=10) == -9
        assert (ev["kind"], ev["pid"], ev["step"], ev["rank"]) == ("kill", proc.pid, 3, 1)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_scale_table_efficiency_faster_step_and_nsa_over_dense():
    rows = [{"case": f"{a}{w}{g}", "attention": a, "seq": 8192, "world": w, "cuda_graph": g, "cp": 1, "toks_per_s": v,
             "step_mode": "cuda_graph (after 3 eager steps)" if g else "eager"}
            for a, w, g, v in [("nsa", 1, True, 100.0), ("nsa", 2, True, 190.0), ("nsa", 2, False, 180.0),
                               ("dense", 1, True, 200.0), ("dense", 2, True, 360.0), ("dense", 2, False, 380.0)]]
    rows.append({"case": "failed", "attention": "nsa", "seq": 65536, "world": 2, "cuda_graph": True, "error": "OOM"})
    table = {(t["attention"], t["seq"]): t for t in gpu_runs.scale_table(rows)}
    n, d = table[("nsa", 8192)], table[("dense", 8192)]
    assert n["eff_graph"] == pytest.approx(0.95) and n["eff_ddp"] == pytest.approx(0.9) and n["faster_2gpu"] == "graph"
    assert d["faster_2gpu"] == "ddp" and d["eff_ddp"] == pytest.approx(0.95)
    assert n["nsa_over_dense_per_gpu"] == pytest.approx(0.5)
    assert n["nsa_over_dense_aggregate"] == pytest.approx(190.0 / 380.0)
    assert ("nsa", 65536) not in table
    assert n["step_modes"] == {"nsa1True": "cuda_graph (after 3 eager steps)", "nsa2True": "cuda_graph (after 3 eager "
                               "steps)", "nsa2False": "eager"}
    assert "graph" in gpu_runs.format_table(list(table.values()))


def test_case_text_names_profile_and_overrides():
    assert gpu_runs.parse_case("f @pipelines/configs/fsdp_1b.yaml a.b=1", "p.yaml") == \
        ("f", "pipelines/configs/fsdp_1b.yaml", ["a.b=1"], None)
    assert gpu_runs.parse_case("g warmup=2 a.b=1", "p.yaml") == ("g", "p.yaml", ["a.b=1"], 2)
    with pytest.raises(SystemExit, match="start with the case's name"):
        gpu_runs.parse_case("a.b=1", "p.yaml")


@pytest.mark.parametrize("sub,cases", [("scale", 16), ("heal", 2), ("past-one", 4), ("job", 0), ("lanes-gpu", 0)])
def test_gpu_subcommands_resolve_every_config_on_cpu(tmp_path, sub, cases):
    """DRY_RUN=1: the configs each Ray-route subcommand would launch (gpu_runs.py runs --dry-run,
    prod_50k.py --print-config, ab_grid.py --print-config) resolve on the CPU; nothing is launched."""
    env = dict(os.environ, DRY_RUN="1", OUT=str(tmp_path), PYTHONPATH=str(REPO))
    out = subprocess.run(["bash", str(REPO / "bench" / "gpu.sh"), sub], capture_output=True, text=True, cwd=REPO,
                         env=env, timeout=600)
    log = (tmp_path / f"{sub.replace('-', '_').replace('_gpu', '')}.log").read_text()
    assert out.returncode == 0 and "rc=0" in log, log[-3000:]
    lines = [ln for ln in log.splitlines() if ln.startswith("case ")]
    assert len(lines) == cases and not [ln for ln in lines if "Error" in ln], log[-3000:]


@pytest.mark.parametrize("cp,streams,expect", [(1, 1, 2 * 512), (2, 1, 512), (1, 2, 2 * 2 * 512)])
def test_case_row_counts_tokens_per_replica_and_stream(tmp_path, cp, streams, expect):
    """Tokens per step: batch x seq x accumulate per data-parallel replica (a CP group trains one sequence)
    and per data stream a rank continues (a resume on fewer ranks); tokens/s from the p50 step."""
    from nsa.config import resolve_config
    cfg, _ = resolve_config(str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml"), [
        "train.seq_len=64", "train.batch_size=8", "runtime.num_workers=2", f"runtime.context_parallel={cp}"])
    run = tmp_path / "r"
    extra = {"data_streams": streams} if streams > 1 else {}
    for rank in (0, 1):
        recs = [{"ts": 1.0, "kind": "start", "step": 0, "rank": rank, "pid": 9, **extra}] + [
            {"ts": 2.0 + s, "kind": "step_end", "step": s, "rank": rank, "pid": 9, "step_ms": 100.0, "fetch_ms": 1.0}
            for s in range(1, 6)]
        run.mkdir(exist_ok=True)
        (run / f"heartbeat_rank{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "metrics.json").write_text(json.dumps({"world_size": 2, "device": "cpu", "step_mode": "eager"}))
    row = gpu_runs.case_row(run, cfg, 2, {"world_size": 2})
    assert row["tokens_per_step"] == expect and row["toks_per_s"] == pytest.approx(expect / 0.1)
    assert row["step_ms_p50"] == 100.0 and row["peak_mem_gib_per_rank"] == {0: 0.0, 1: 0.0}


def test_runs_stop_after_a_halted_case_and_go_on_after_a_failed_one(tmp_path, monkeypatch):
    """A case that fails is its row (with the one-line error) and the next case runs; a case halted (the
    driver's answer to T_RUN's SIGTERM) keeps its row and no later case is launched."""
    from nsa.launch import builder
    launched = []

    def fake_launch(cfg, src, prefix="run", quiet=False):
        launched.append(cfg.logging.name)
        status = {"bad": "failed", "cut": "halted"}.get(cfg.logging.name, "completed")
        return builder.Outcome(run_dir=tmp_path / cfg.logging.name, exit_code=int(status == "failed"), wall_s=1.0,
                               summary={"status": status, "reason": "boom" if status == "failed" else "",
                                        "step_mode": "eager"})

    monkeypatch.setattr(builder, "launch", fake_launch)
    monkeypatch.setattr(gpu_runs, "case_row", lambda run_dir, cfg, warm, summary: {"toks_per_s": 10.0 * warm,
                                                                                   "step_ms_p50": 5.0})
    out = tmp_path / "rows.json"
    rows = gpu_runs.run_cases(["bad", "ok warmup=3", "cut", "never"], out, 2, 1, "pipelines/configs/tiny_cpu.yaml",
                              ["train.seq_len=64"], tmp_path)
    assert launched == ["bad", "ok", "cut"]
    assert [(r["case"], r.get("status"), r.get("error")) for r in rows] == \
        [("bad", "failed", "failed: boom"), ("ok", "completed", None), ("cut", "halted", None)]
    assert rows[1]["toks_per_s"] == 30.0 and rows[1]["steps"] == 5          # its own warm-up: 3 + 2 steps
    assert [r["case"] for r in json.loads(out.read_text())["rows"]] == ["bad", "ok", "cut"]
