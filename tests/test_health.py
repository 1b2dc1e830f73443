"""Gate health warnings (nsa/telemetry/health.py): the rule itself, `check` on a run without training.csv
(heartbeats only), fallback counters, memory growth, and the live warning line of a tiny local run."""
from __future__ import annotations

import os

import torch

from conftest import TINY_PROFILE, tiny_overrides
from nsa.config import resolve_config
from nsa.telemetry import Heartbeat, read_heartbeat, run_checks
from nsa.telemetry.check import main
from nsa.telemetry.health import gate_violations


def test_gate_violations_per_layer_and_configurable():
    stats = {"gate/L0/entropy": 1.0, "gate/L0/max_gate": 0.98, "gate/L0/collapse_frac": 0.0,
             "gate/L1/entropy": 0.2, "gate/L1/max_gate": 0.5, "gate/L1/collapse_frac": 0.3,
             "sel/L0/free_frac": 0.0, "gate/L2/entropy": float("nan")}
    assert gate_violations(stats) == ["gate/L0/max_gate=0.98 > 0.9", "gate/L1/collapse_frac=0.3 > 0.05",
                                      "gate/L1/entropy=0.2 < 0.5"]
    # a layer that favours the window branch on purpose: raise or disable the rule
    assert gate_violations(stats, {"max_gate": None, "min_entropy": 0.1, "max_collapse": 0.5}) == []


def _hb_run(run_dir, *, entropy=1.0, max_gate=0.5, fallbacks=None, mem=(300.0,) * 20):
    hb = Heartbeat(run_dir, rank=0)
    hb.write("start", 0)
    for i, m in enumerate(mem, start=1):
        hb.write("step_end", i, loss=5.0 - 0.1 * i, mem_mib=m, fallbacks=fallbacks or {})
        if i % 5 == 0:
            hb.write("progress", i, stats={"gate/L0/entropy": entropy, "gate/L0/max_gate": max_gate,
                                           "gate/L0/collapse_frac": 0.0})
    hb.write("end", len(mem))
    hb.close()
    return run_dir


def _status(results):
    return {r.name: r.status for r in results}


def test_check_reads_heartbeats_when_csv_is_off(tmp_path, capsys):
    good = _status(run_checks(_hb_run(tmp_path / "good")))
    assert [good[k] for k in ("gate_entropy", "gate_max", "gate_collapse", "kernel_fallbacks",
                              "memory_growth")] == ["PASS"] * 5
    bad_run = _hb_run(tmp_path / "bad", entropy=0.1, max_gate=0.97, fallbacks={"selection:triton": 3},
                      mem=[300.0 + 20 * i for i in range(20)])
    bad = _status(run_checks(bad_run))
    assert [bad[k] for k in ("gate_entropy", "gate_max", "kernel_fallbacks", "memory_growth")] == ["WARN"] * 4
    assert bad["gate_collapse"] == "PASS"
    assert main([str(bad_run)]) == 0                       # warnings never fail the check
    assert "(with warnings)" in capsys.readouterr().out
    assert _status(run_checks(bad_run, max_gate=0.99, max_mem_growth=5.0))["gate_max"] == "PASS"


def test_live_warning_line_and_heartbeat(tiny_data, tmp_path, capsys):
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import run_training
    # entropy can never reach 2 nats over 3 branches: every stats step violates the rule
    cfg, _ = resolve_config(TINY_PROFILE, tiny_overrides(
        tiny_data, tmp_path, logging__name="h", model__n_layers=1, model__dim=64, train__steps=4,
        train__save_every=0, train__eval_every=0, logging__stats_every=2, logging__csv=False,
        logging__health_min_entropy=2.0))
    torch.set_num_threads(2)
    run_dir = os.path.join(cfg.logging.root, "h")
    run_training(cfg, run_dir, LocalEnv(cfg, run_dir))
    out = capsys.readouterr().out
    assert out.count("gate health warning") == 1 and "gate/L0/entropy=" in out   # printed once, not per step
    prog = [r for r in read_heartbeat(os.path.join(run_dir, "heartbeat_rank0.jsonl")) if "stats" in r]
    assert [r["step"] for r in prog] == [2, 4] and all("< 2" in r["health_warnings"][0] for r in prog)
    assert _status(run_checks(run_dir, min_entropy=2.0))["gate_entropy"] == "WARN"   # from heartbeats
