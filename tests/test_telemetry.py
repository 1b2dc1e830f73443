"""Heartbeat, watchdog, signals/control files, on-device stats, percentiles, memory."""
from __future__ import annotations

import logging

import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nsa.telemetry import (ControlFiles, ControlFlags, Heartbeat, RollingPercentiles, Watchdog, dump_stacks,
                           gate_stats, install_signal_handlers, layer_stats, make_stall_handler, memory_mib,
                           read_heartbeat, restore_signal_handlers, selection_stats, to_host)


def _wait_for(predicate, timeout: float = 10.0) -> bool:
    """Poll until predicate() is true (waits for an event; never asserts on durations)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---------------------------------------------------------------- heartbeat
def test_heartbeat_record_format(tmp_path):
    hb = Heartbeat(tmp_path / "run", rank=3)
    before = time.time()
    rec = hb.write("step_end", 7, loss=float("nan"), toks_per_s=412.5, note="x")
    hb.write("end", 8)
    hb.close()
    path = tmp_path / "run" / "heartbeat_rank3.jsonl"
    assert hb.path == path
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    raw = json.loads(lines[0])  # strict JSON: NaN written as a string
    assert raw["loss"] == "NaN"
    assert set(raw) == {"ts", "iso", "kind", "step", "rank", "pid", "loss", "toks_per_s", "note"}
    recs = read_heartbeat(path)
    assert recs[0]["kind"] == "step_end" and recs[0]["step"] == 7 and recs[0]["rank"] == 3
    assert recs[0]["pid"] == os.getpid() and math.isnan(recs[0]["loss"])
    assert before <= recs[0]["ts"] <= time.time()
    assert recs[0]["iso"].startswith(time.strftime("%Y", time.gmtime(recs[0]["ts"])))
    assert recs[1]["kind"] == "end" and rec["toks_per_s"] == 412.5


def test_heartbeat_rejects_bad_input(tmp_path):
    hb = Heartbeat(tmp_path, rank=0)
    with pytest.raises(ValueError, match="reserved"):
        hb.write("progress", 1, rank=5)
    with pytest.raises(ValueError, match="kind"):
        hb.write("", 1)
    with pytest.raises(ValueError, match="step"):
        hb.write("progress", "abc")
    hb.close()
    with pytest.raises(ValueError, match="closed"):
        hb.write("progress", 1)


def test_heartbeat_thread_safe(tmp_path):
    hb = Heartbeat(tmp_path, rank=0)
    payload = "y" * 2000  # long lines would interleave if writes were not serialised

    def writer(tid: int) -> None:
        for i in range(200):
            hb.write("progress", i, tid=tid, payload=payload)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hb.close()
    lines = (tmp_path / "heartbeat_rank0.jsonl").read_text().splitlines()
    assert len(lines) == 800
    recs = [json.loads(line) for line in lines]  # every line parses: none torn or merged
    for tid in range(4):
        assert [r["step"] for r in recs if r["tid"] == tid] == list(range(200))


def test_heartbeat_disabled_writes_nothing(tmp_path):
    hb = Heartbeat(tmp_path / "off", rank=0, enabled=False)
    assert hb.write("step_end", 1)["kind"] == "step_end"
    assert not (tmp_path / "off").exists()


# ---------------------------------------------------------------- watchdog
def test_watchdog_fires_once_per_episode_fake_clock():
    now = [0.0]
    calls: list[float] = []
    wd = Watchdog(10.0, calls.append, clock=lambda: now[0])
    wd.kick()
    now[0] = 9.9
    assert not wd.check()
    now[0] = 12.0
    assert wd.check() and calls == [12.0]
    now[0] = 30.0
    assert not wd.check() and len(calls) == 1  # same episode: no second call
    wd.kick()  # progress ends the episode
    now[0] = 39.0
    assert not wd.check()
    now[0] = 41.0
    assert wd.check() and calls[-1] == pytest.approx(11.0) and wd.stall_count == 2


def test_watchdog_kicked_never_fires_and_pause():
    now = [0.0]
    calls: list[float] = []
    wd = Watchdog(1.0, calls.append, clock=lambda: now[0])
    for _ in range(100):  # steady progress, each step shorter than the stall window
        now[0] += 0.5
        wd.kick()
        assert not wd.check()
    with wd.paused():
        now[0] += 50.0
        assert not wd.check()  # a known-long phase is not a stall
    assert not wd.check() and calls == []


def test_watchdog_thread_writes_stack_dump_and_stall_heartbeat(tmp_path):
    hb = Heartbeat(tmp_path, rank=0)
    fired = threading.Event()
    handler = make_stall_handler(tmp_path, hb, get_step=lambda: 42)

    def on_stall(age: float) -> None:
        handler(age)
        fired.set()

    with Watchdog(0.2, on_stall, poll_seconds=0.05) as wd:
        assert wd.running
        assert fired.wait(10.0), "watchdog did not fire on a stall"
    hb.close()
    stall = [r for r in read_heartbeat(hb.path) if r["kind"] == "stall"]
    assert len(stall) == 1 and stall[0]["step"] == 42 and stall[0]["seconds_since_kick"] >= 0.2
    dump = Path(stall[0]["stack_dump"])
    assert dump.parent == tmp_path and dump.name.startswith("stackdump_")
    text = dump.read_text()
    # the main thread's Python stack (this test) and the watchdog thread both appear
    assert "test_watchdog_thread_writes_stack_dump_and_stall_heartbeat" in text
    assert "nsa-watchdog" in text and "faulthandler" in text


def test_watchdog_handler_error_does_not_kill_thread():
    now = [0.0]

    def boom(age: float) -> None:
        raise RuntimeError("handler bug")

    wd = Watchdog(1.0, boom, clock=lambda: now[0])
    now[0] = 2.0
    assert wd.check() and wd.stall_count == 1
    with pytest.raises(ValueError, match="stall_seconds"):
        Watchdog(0, boom)


def test_dump_stacks_names_threads(tmp_path):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="parked-worker", daemon=True)
    t.start()
    try:
        path = dump_stacks(tmp_path)  # a directory: a new file is created in it
    finally:
        stop.set()
        t.join()
    assert path.parent == tmp_path and path.suffix == ".txt"
    assert "'parked-worker'" in path.read_text()
    explicit = dump_stacks(tmp_path / "sub" / "x.txt")
    assert explicit == tmp_path / "sub" / "x.txt" and explicit.stat().st_size > 0


# ---------------------------------------------------------------- signals / control files
@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")
def test_signal_handlers_main_thread(tmp_path):
    flags = ControlFlags()
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    assert install_signal_handlers(tmp_path, flags.request_checkpoint, flags.request_stop)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert _wait_for(lambda: any(p.name.startswith("stackdump_2") for p in tmp_path.iterdir()))
        py_dump = next(p for p in tmp_path.iterdir() if p.name.startswith("stackdump_2"))
        assert "test_signal_handlers_main_thread" in py_dump.read_text()
        native = tmp_path / f"stackdump_native_pid{os.getpid()}.txt"
        assert _wait_for(lambda: native.exists() and "test_signal_handlers_main_thread" in native.read_text())
        assert not flags.checkpoint_requested and not flags.stop_requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert _wait_for(lambda: flags.checkpoint_requested)
        assert flags.take_checkpoint_request() and not flags.take_checkpoint_request()
        os.kill(os.getpid(), signal.SIGTERM)  # first SIGTERM only sets the flag
        assert _wait_for(lambda: flags.stop_requested) and flags.stop_reason == "SIGTERM"
    finally:
        restore_signal_handlers()
    assert {s: signal.getsignal(s) for s in before} == before


def test_signal_handlers_refused_off_main_thread(tmp_path):
    # capture on the module's own logger: libraries imported by earlier tests (Ray, MLflow) may
    # reconfigure the root logger or disable propagation, which would blind pytest's caplog
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("nsa.telemetry.signals")
    logger.addHandler(handler)
    old_disabled, logger.disabled = logger.disabled, False
    try:
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("ok", install_signal_handlers(
            tmp_path, lambda: None, lambda: None)))
        t.start()
        t.join()
    finally:
        logger.removeHandler(handler)
        logger.disabled = old_disabled
    assert result["ok"] is False
    text = "\n".join(r.getMessage() for r in records)
    assert "not the main thread" in text and "ControlFiles" in text


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_second_sigterm_terminates(tmp_path):
    """First SIGTERM: flag only. Second: default action (the process dies). Checked in a forked child."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest; report through the exit status
        code = 5
        try:
            flags = ControlFlags()
            code = 3 if not install_signal_handlers(tmp_path, flags.request_checkpoint, flags.request_stop) else 4
            if code == 4:
                os.kill(os.getpid(), signal.SIGTERM)
                code = 6 if not flags.stop_requested else 7
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), f"child exited with code {os.waitstatus_to_exitcode(status)}"
    assert os.WTERMSIG(status) == signal.SIGTERM


def test_control_files(tmp_path):
    now = [0.0]
    cf = ControlFiles(tmp_path, min_interval_s=1.0, clock=lambda: now[0])
    flags = cf.poll()
    assert not flags.stop_requested and not flags.checkpoint_requested
    (tmp_path / ".CHECKPOINT").touch()
    now[0] = 0.5
    cf.poll(flags)
    assert not flags.checkpoint_requested  # rate-limited: not looked at yet
    now[0] = 1.6
    cf.poll(flags)
    assert flags.take_checkpoint_request() and not (tmp_path / ".CHECKPOINT").exists()
    (tmp_path / ".HALT").write_text("halt: manual_stop\n")
    cf.poll(flags, force=True)
    assert flags.stop_requested and "manual_stop" in flags.stop_reason
    assert (tmp_path / ".HALT").exists()  # kept so restarted workers halt too
    assert not flags.checkpoint_requested
    cf.clear()
    assert not (tmp_path / ".HALT").exists()


# ---------------------------------------------------------------- stats
def test_gate_stats_uniform_and_one_hot():
    uni = gate_stats(torch.full((2, 5, 4, 3), 0.37))
    assert all(v.ndim == 0 for v in uni.values())
    assert uni["entropy"].item() == pytest.approx(math.log(3), abs=1e-5)
    assert uni["collapse_frac"].item() == 0.0
    assert uni["max_gate"].item() == pytest.approx(1 / 3, abs=1e-6)
    for b in ("cmp", "slc", "win"):
        assert uni[f"share_{b}"].item() == pytest.approx(1 / 3, abs=1e-6)
    assert uni["raw_mean"].item() == pytest.approx(0.37, abs=1e-6)

    one_hot = torch.zeros(2, 6, 4, 3)
    one_hot[..., 1] = 0.8  # every (token, head) uses only the selection branch
    oh = gate_stats(one_hot)
    assert oh["collapse_frac"].item() == 1.0 and oh["entropy"].item() == pytest.approx(0.0, abs=1e-6)
    assert oh["share_slc"].item() == pytest.approx(1.0) and oh["share_cmp"].item() == 0.0


def test_gate_stats_mixture_and_threshold():
    g = torch.full((1, 4, 2, 3), 0.5)
    g[0, :2, :, :] = torch.tensor([0.9, 0.0, 0.0])  # half the (token, head) pairs collapse to cmp
    s = gate_stats(g)
    assert s["collapse_frac"].item() == pytest.approx(0.5)
    assert s["entropy"].item() == pytest.approx(math.log(3) / 2, abs=1e-5)
    assert s["share_cmp"].item() == pytest.approx(0.5 + 0.5 / 3, abs=1e-6)
    tilted = torch.tensor([0.8, 0.1, 0.1]).expand(3, 3)  # normalised max = 0.8
    assert gate_stats(tilted)["collapse_frac"].item() == 0.0
    assert gate_stats(tilted, collapse_threshold=0.7)["collapse_frac"].item() == 1.0
    with pytest.raises(ValueError, match="last dimension 3"):
        gate_stats(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="collapse_threshold"):
        gate_stats(torch.zeros(2, 3), collapse_threshold=1.5)


def test_selection_stats_hand_made():
    # l_sel = 4; queries at positions 3, 9, 21 -> query blocks 0, 2, 5
    block_idx = torch.tensor([[[[0, -1, -1, -1]],      # forced block 0 only
                               [[0, 1, 2, -1]],        # 0, previous and own block: all forced
                               [[0, 2, 4, 5]]]])       # block 2 is the one chosen by score
    assert block_idx.shape == (1, 3, 1, 4)
    s = selection_stats(block_idx, l_sel=4, positions=torch.tensor([3, 9, 21]))
    assert s["valid_slots"].item() == pytest.approx(8 / 3)
    assert s["fill_frac"].item() == pytest.approx(8 / 12)
    # distances: 0 | 2,1,0 | 5,3,1,0 -> 12 over 8 used slots
    assert s["mean_dist_blocks"].item() == pytest.approx(1.5)
    assert s["free_frac"].item() == pytest.approx(1 / 8)
    # default positions 0..T-1 (prefill); [B, T] positions broadcast too
    s2 = selection_stats(block_idx, l_sel=4, positions=torch.tensor([[3, 9, 21]]))
    assert s2["free_frac"].item() == pytest.approx(1 / 8)
    empty = selection_stats(torch.full((1, 2, 1, 3), -1), l_sel=4)
    assert empty["valid_slots"].item() == 0.0 and math.isnan(empty["free_frac"].item())
    with pytest.raises(ValueError, match="B, T, H, n_sel"):
        selection_stats(torch.zeros(3, 4, dtype=torch.long), l_sel=4)
    with pytest.raises(ValueError, match="positions"):
        selection_stats(block_idx, l_sel=4, positions=torch.tensor([1, 2]))


def test_layer_stats_and_to_host():
    gates = torch.full((1, 8, 2, 3), 0.5)
    bidx = torch.tensor([0, -1]).expand(1, 8, 1, 2)
    layers = [SimpleNamespace(last_gates=gates, last_block_idx=bidx, l_sel=64),
              SimpleNamespace(last_gates=None, last_block_idx=None, l_sel=64),
              SimpleNamespace(last_gates=gates * 0 + torch.tensor([1.0, 0.0, 0.0]), last_block_idx=None)]
    model = SimpleNamespace(nsa_layers=lambda: layers)
    stats = layer_stats(model, prefix="train/")
    assert "train/gate/L0/entropy" in stats and "train/sel/L0/valid_slots" in stats
    assert not any("/L1/" in k for k in stats)
    assert "train/gate/L2/collapse_frac" in stats and "train/sel/L2/free_frac" not in stats
    host = to_host({**stats, "plain": 3})
    assert list(host) == list(stats) + ["plain"]
    assert all(type(v) is float for v in host.values())
    assert host["train/gate/L0/entropy"] == pytest.approx(math.log(3), abs=1e-5)
    assert host["train/gate/L2/collapse_frac"] == 1.0 and host["train/sel/L0/valid_slots"] == 1.0
    with pytest.raises(ValueError, match="l_sel"):
        layer_stats([SimpleNamespace(last_gates=None, last_block_idx=bidx)])
    with pytest.raises(ValueError, match="0-d"):
        to_host({"v": torch.zeros(3)})


def test_rolling_percentiles():
    rp = RollingPercentiles(window=5)
    assert math.isnan(rp.p50) and math.isnan(rp.mean)
    for x in [10, 1, 4, 3, 2]:
        rp.add(x)
    assert rp.p50 == 3 and rp.mean == 4.0
    assert rp.p95 == pytest.approx(4 + 0.8 * 6)  # numpy-style linear interpolation
    rp.add(100)  # evicts the oldest (10)
    assert len(rp) == 5 and rp.count == 6
    assert rp.percentile(0) == 1 and rp.percentile(100) == 100 and rp.p50 == 3
    with pytest.raises(ValueError):
        RollingPercentiles(window=0)


def test_memory_mib():
    m = memory_mib("cpu")
    assert m["rss_mib"] > 10 and m["mem_mib"] == m["rss_mib"]
    assert "cuda_alloc_mib" not in m
