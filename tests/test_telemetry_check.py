"""``python -m nsa.telemetry.check`` on synthetic good and bad run directories."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


from nsa.telemetry import CSVLogger, Heartbeat, run_checks
from nsa.telemetry.check import main

REPO = Path(__file__).resolve().parents[1]


def _make_run(run_dir: Path, *, losses=None, stall_at=None, end=True, entropy=1.0, collapse=0.0,
              fetch_p95=5.0, n=40) -> Path:
    losses = losses if losses is not None else [5.0 - 3.0 * i / n for i in range(n)]
    lg = CSVLogger(run_dir / "training.csv")
    hb = Heartbeat(run_dir, rank=0)
    hb.write("start", 0)
    for i, loss in enumerate(losses, start=1):
        hb.write("step_start", i)
        row = {"loss": loss, "lr": 1e-3, "toks_per_s": 1000.0 + i, "step_ms": 50.0, "fetch_ms_p50": 1.0,
               "fetch_ms_p95": fetch_p95, "grad_norm": 1.0, "mem_mib": 300.0}
        if i % 10 == 0:  # gate stats every N steps
            row.update({"gate/L0/entropy": entropy, "gate/L0/collapse_frac": collapse, "gate/L0/max_gate": 0.5,
                        "gate/L1/entropy": 1.05, "gate/L1/collapse_frac": 0.0, "gate/L1/max_gate": 0.4})
        lg.log(row, i)
        hb.write("step_end", i, loss=loss, fallbacks={})
        if stall_at == i:
            hb.write("stall", i, seconds_since_kick=300.0)
    if end:
        hb.write("end", len(losses))
    hb.close()
    lg.close()
    return run_dir


def _status(results):
    return {r.name: r.status for r in results}


def test_good_run_passes(tmp_path, capsys):
    run = _make_run(tmp_path / "good")
    st = _status(run_checks(run, min_toks_per_s=500, min_steps=40))
    assert set(st.values()) == {"PASS"}, st
    assert main([str(run), "--min-toks-per-s", "500"]) == 0
    out = capsys.readouterr().out
    assert "overall: PASS" in out and "loss_improving" in out and "FAIL" not in out


def test_bad_runs_fail(tmp_path):
    nan_run = _make_run(tmp_path / "nan", losses=[5.0, 4.0, float("nan"), 3.0, 2.0])
    st = _status(run_checks(nan_run))
    assert st["loss_finite"] == "FAIL"
    assert main([str(nan_run)]) == 1

    stall_run = _make_run(tmp_path / "stall", stall_at=7)
    assert _status(run_checks(stall_run))["no_stall_or_anomaly"] == "FAIL"
    assert main([str(stall_run)]) == 1

    rising = _make_run(tmp_path / "rising", losses=[2.0 + 0.1 * i for i in range(30)])
    assert _status(run_checks(rising))["loss_improving"] == "FAIL"

    # gate health is a warning (a healthy model may favour one branch in some layers): exit 0
    gates = _make_run(tmp_path / "gates", entropy=0.1, collapse=0.6)
    st = _status(run_checks(gates))
    assert st["gate_entropy"] == "WARN" and st["gate_collapse"] == "WARN" and st["gate_max"] == "PASS"
    assert st["loss_improving"] == "PASS" and st["loss_finite"] == "PASS"
    assert main([str(gates)]) == 0
    assert _status(run_checks(gates, min_entropy=0.05, max_collapse=0.7))["gate_entropy"] == "PASS"

    slow = _make_run(tmp_path / "slow", fetch_p95=2500.0)
    st = _status(run_checks(slow, min_toks_per_s=5000))
    assert st["fetch_p95"] == "FAIL" and st["throughput"] == "FAIL"


def test_heartbeat_freshness(tmp_path):
    run = _make_run(tmp_path / "live", end=False)  # still running: no `end` record
    assert _status(run_checks(run))["heartbeat_fresh"] == "PASS"
    later = time.time() + 600  # ten minutes without a heartbeat
    res = {r.name: r for r in run_checks(run, now=later)}
    assert res["heartbeat_fresh"].status == "FAIL" and "heartbeat_rank0.jsonl" in res["heartbeat_fresh"].detail
    ended = _make_run(tmp_path / "ended", end=True)
    assert _status(run_checks(ended, now=later))["heartbeat_fresh"] == "PASS"


def test_heartbeat_only_run(tmp_path):
    """CSV logging off (old NSA_DISABLE_CSV_LOGS): loss comes from step_end heartbeats."""
    run = _make_run(tmp_path / "hb", losses=[3.0, float("inf")])
    (run / "training.csv").unlink()
    st = _status(run_checks(run))
    assert st["loss_finite"] == "FAIL" and st["throughput"] == "SKIP"


def test_cli_exit_codes_and_json(tmp_path, capsys):
    good = _make_run(tmp_path / "good")
    bad = _make_run(tmp_path / "bad", stall_at=3)
    assert main([str(good), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "PASS" and {c["status"] for c in report["checks"]} <= {"PASS", "SKIP"}
    assert main([str(tmp_path / "does-not-exist")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    # one real `python -m` run (it imports torch via nsa/__init__, a few seconds): exit status reaches the shell
    p = subprocess.run([sys.executable, "-m", "nsa.telemetry.check", str(bad)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1, p.stderr
    assert "no_stall_or_anomaly" in p.stdout and "overall: FAIL" in p.stdout


def test_nan_placeholder_in_progress_record_is_not_a_nonfinite_loss(tmp_path):
    # the trainer's first `progress` record carries loss=NaN before any loss was measured
    _make_run(tmp_path)
    Heartbeat(tmp_path, rank=0).write("progress", 1, loss=float("nan"))
    assert _status(run_checks(tmp_path))["loss_finite"] == "PASS"
    # a NaN in a completed step still fails
    Heartbeat(tmp_path, rank=0).write("step_end", 2, loss=float("nan"))
    assert _status(run_checks(tmp_path))["loss_finite"] == "FAIL"
