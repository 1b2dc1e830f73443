"""train.on_stall: what the watchdog does after the stall record and stack dump.

Unit checks drive make_stall_handler with an injected exit; the Ray test injects a stall on rank 0
(runtime.fault=stall@N) under on_stall=restart: the watchdog ends the worker with STALL_EXIT_CODE,
FailureConfig restarts the group from the last checkpoint, and the steps run twice give the same losses."""
from __future__ import annotations

import time

import pytest

from conftest import TINY_PROFILE, tiny_overrides
from nsa.config import ConfigError, resolve_config
from nsa.telemetry import STALL_EXIT_CODE, Heartbeat, Watchdog, make_stall_handler, read_heartbeat


def test_profiles_default_on_stall():
    assert resolve_config(TINY_PROFILE, [])[0].train.on_stall == "record"
    for name in ("prod_50k", "long_32k"):
        cfg, _ = resolve_config(TINY_PROFILE.replace("tiny_cpu", name), [])
        assert cfg.train.on_stall == "restart", name
    with pytest.raises(ConfigError, match="train.on_stall"):
        resolve_config(TINY_PROFILE, ["train.on_stall=reboot"])


def _handler(tmp_path, action, **kw):
    exits: list[int] = []
    hb = Heartbeat(tmp_path, rank=0)
    return make_stall_handler(tmp_path, hb, lambda: 7, action=action, exit_fn=exits.append, **kw), exits


def test_record_only_records(tmp_path):
    on_stall, exits = _handler(tmp_path, "record")
    on_stall(3.0)
    assert exits == [] and not (tmp_path / ".HALT").exists()
    assert len(list(tmp_path.glob("stackdump_*_stall.txt"))) == 1
    stall = [r for r in read_heartbeat(tmp_path / "heartbeat_rank0.jsonl") if r["kind"] == "stall"]
    assert [(r["step"], r["action"], r["exiting"]) for r in stall] == [(7, "record", False)]


def test_restart_exits_with_the_stall_code_after_the_dump(tmp_path):
    on_stall, exits = _handler(tmp_path, "restart")
    on_stall(3.0)
    assert exits == [STALL_EXIT_CODE] and list(tmp_path.glob("stackdump_*_stall.txt"))


@pytest.mark.parametrize("healed", [True, False])
def test_halt_writes_halt_then_exits_only_if_still_stuck(tmp_path, healed):
    on_stall, exits = _handler(tmp_path, "halt", is_stalled=lambda: not healed, grace_seconds=0.05)
    on_stall(3.0)
    assert "on_stall=halt" in (tmp_path / ".HALT").read_text()
    time.sleep(0.5)
    assert exits == ([] if healed else [STALL_EXIT_CODE])


def test_watchdog_stalled_flag_follows_kicks():
    now = [0.0]
    wd = Watchdog(1.0, lambda s: None, clock=lambda: now[0])
    wd.kick()
    now[0] = 2.0
    assert wd.check() and wd.stalled
    wd.kick()
    assert not wd.stalled


STEPS, SAVE, STALL_AT = 12, 4, 7


@pytest.mark.ray
def test_stalled_rank_is_restarted_and_repeats_the_same_losses(ray_session, tiny_data, tmp_path):
    from nsa.launch import builder
    cfg, src = resolve_config(TINY_PROFILE, tiny_overrides(
        tiny_data, tmp_path, logging__name="st", train__steps=STEPS, train__save_every=SAVE, train__eval_every=0,
        train__stall_seconds=5, train__on_stall="restart", runtime__fault=f"stall@{STALL_AT}",
        runtime__max_failures=2))
    out = builder.launch(cfg, src, prefix="stall")
    assert out.exit_code == 0 and out.summary["status"] == "completed" and out.summary["step"] == STEPS
    hb = read_heartbeat(out.run_dir / "heartbeat_rank0.jsonl")
    # rank 0 sleeps in the injected stall and rank 1 waits for it in the gradient all-reduce: either
    # watchdog may fire first, and its exit ends the group, so the record is in one of the two files
    stalls = [r for rank in (0, 1) for r in read_heartbeat(out.run_dir / f"heartbeat_rank{rank}.jsonl")
              if r["kind"] == "stall"]
    assert stalls and stalls[0]["action"] == "restart" and stalls[0]["step"] == STALL_AT - 1
    # steps SAVE+1 .. STALL_AT-1 ran before the stall and again after the restart from checkpoint SAVE
    by_pid: dict[int, dict[int, float]] = {}
    for r in hb:
        if r["kind"] == "step_end" and SAVE < r["step"] < STALL_AT:
            by_pid.setdefault(r["pid"], {})[r["step"]] = r["loss"]
    assert len(by_pid) == 2, by_pid
    before, after = by_pid.values()
    assert sorted(before) == sorted(after) == list(range(SAVE + 1, STALL_AT))
    for k in before:
        assert after[k] == pytest.approx(before[k], rel=1e-4, abs=1e-4), k
