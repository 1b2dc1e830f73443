"""bench/bench_train.py: --tiny runs the bare loop and writes its JSON (a crash test, no timing asserted);
the Ray row is computed from a pipeline run's heartbeats (tests/test_pipeline_e2e.py feeds it a real run)."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))


def test_bench_train_tiny_bare(tiny_data, tmp_path, monkeypatch, capsys):
    import bench_train
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--tiny", "--skip-ray", "--steps", "3", "--warmup", "1",
                                      "--out-dir", str(tmp_path / "bench"), f"data.path={tiny_data}"])
    assert bench_train.main() == 0
    out = capsys.readouterr().out
    assert "bare" in out and "MFU" in out
    rep = json.loads((tmp_path / "out" / "bench_train.json").read_text())
    assert [r["mode"] for r in rep["rows"]] == ["bare"]
    assert rep["rows"][0]["toks_per_s"] > 0 and rep["rows"][0]["step_ms_p50"] > 0
    f = rep["flops_per_token"]
    # the analytic count and torch's FlopCounterMode (torch backend) agree within 15%
    assert f["counted_train_per_token_torch_backend"] == pytest.approx(f["train_per_token"], rel=0.15)
    assert list((tmp_path / "bench").glob("bench_train_*.json"))


def test_attention_flops_match_a_direct_count():
    """The per-sequence attention count: compressed blocks visible + selected + window keys, per head."""
    import bench_train
    from nsa.config import RunConfig
    cfg = RunConfig()
    cfg.train.seq_len, cfg.nsa.l, cfg.nsa.d, cfg.nsa.l_sel, cfg.nsa.n_sel, cfg.nsa.w = 64, 16, 8, 16, 2, 32
    keys = sum(max(0, (t + 1 - 16) // 8 + 1) + min(32, t + 1) + min(32, t + 1) for t in range(64))
    per_key = 2 * (cfg.model.d_k + cfg.model.d_v)
    assert bench_train.attention_flops_per_seq(cfg) == per_key * keys * cfg.model.n_heads
