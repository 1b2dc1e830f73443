"""A run dir holds a stackdump file only where a dump happened: the SIGUSR1 files that faulthandler needs open
in advance (nsa/train/control.py SignalFiles, nsa/telemetry/signals.py native dump) go away at close if empty."""
from __future__ import annotations

import os
import signal
import time

import pytest

from nsa.telemetry.signals import close_dump_file, install_signal_handlers, restore_signal_handlers
from nsa.train.control import SignalFiles

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


def _dumps(d):
    return sorted(p.name for p in d.glob("stackdump_*"))


def test_no_signal_leaves_no_stackdump_file(tmp_path):
    sf = SignalFiles(tmp_path, rank=0)
    assert _dumps(tmp_path) == ["stackdump_sigusr1_rank0.txt"]     # open while the loop runs
    sf.close()
    assert _dumps(tmp_path) == []
    assert (tmp_path / ".signals" / "signal_sigusr2_rank0.txt").is_file()   # bookkeeping stays


def test_a_dump_is_kept(tmp_path):
    sf = SignalFiles(tmp_path, rank=1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.time() + 5
        while not sf.poll() and time.time() < deadline:
            time.sleep(0.02)
    finally:
        sf.close()
    dump = tmp_path / "stackdump_sigusr1_rank1.txt"
    assert "test_a_dump_is_kept" in dump.read_text()
    # a restarted worker of the same rank reopens it and must not delete the earlier dump
    SignalFiles(tmp_path, rank=1).close()
    assert dump.is_file() and dump.stat().st_size > 0


def test_native_dump_file_removed_when_unused(tmp_path):
    assert install_signal_handlers(tmp_path, lambda: None, lambda: None)
    try:
        assert _dumps(tmp_path) == [f"stackdump_native_pid{os.getpid()}.txt"]
    finally:
        restore_signal_handlers()
    assert _dumps(tmp_path) == []


def test_close_dump_file_keeps_content(tmp_path):
    kept, empty = tmp_path / "a.txt", tmp_path / "b.txt"
    fa, fb = open(kept, "a"), open(empty, "a")
    fa.write("stack\n")
    fa.flush()
    close_dump_file(fa)
    close_dump_file(fb)
    assert kept.read_text() == "stack\n" and not empty.exists()
