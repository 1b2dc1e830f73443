"""pipelines/smoke.py on the tiny profile (in-process, sharing the session's Ray instance): GO on a healthy
run, NO-GO with a report naming the stall when one is injected."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import PIPELINES, load_entry_point, tiny_overrides

pytestmark = pytest.mark.ray


def _smoke(monkeypatch, args):
    smoke = load_entry_point(PIPELINES / "smoke.py")
    monkeypatch.setattr(sys, "argv", ["smoke.py", *args])
    return smoke.main()


def test_smoke_go(ray_session, tiny_data, tmp_path, monkeypatch, capsys):
    # DDP with gradient accumulation (no_sync) and gradient checkpointing on top of the tiny profile
    code = _smoke(monkeypatch, ["--phase1-steps", "20", *tiny_overrides(
        tiny_data, tmp_path, logging__name="s", train__accumulate=2, model__grad_checkpointing=True)])
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "s" / "smoke_report.json").read_text())
    assert code == 0 and report["decision"] == "GO", out[-3000:]
    assert [p["ok"] for p in report["phases"]] == [True, True]
    names = {c["check"] for c in report["phases"][1]["checks"]}
    assert {"no stall", "loss finite beyond step 5", "steady step time", "flat memory"} <= names
    assert "# NSA smoke: **GO**" in out and (tmp_path / "s" / "smoke_report.md").is_file()


def test_smoke_no_go_on_injected_stall(ray_session, tiny_data, tmp_path, monkeypatch, capsys):
    args = ["--phase1-steps", "10", *tiny_overrides(tiny_data, tmp_path, logging__name="s",
                                                    runtime__fault="stall@2", train__stall_seconds=2)]
    code = _smoke(monkeypatch, args)
    capsys.readouterr()
    report = json.loads((tmp_path / "s" / "smoke_report.json").read_text())
    assert code == 1 and report["decision"] == "NO-GO"
    phase0 = report["phases"][0]
    assert len(report["phases"]) == 1 and not phase0["ok"]              # Phase 1 not started after a failure
    stall = next(c for c in phase0["checks"] if c["check"] == "no stall")
    assert not stall["ok"] and "step 1" in stall["detail"]              # stuck after step 1, before step 2
    assert "NO-GO" in (tmp_path / "s" / "smoke_report.md").read_text()
