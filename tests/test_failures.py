"""Failures say their cause first, user errors are not retried, and a local run listens on loopback only
(issue 46, items 5 and 7). Pre-Ray refusals run train.py in-process with connect_ray failing the test; the
one Ray test runs a tiny job on a shard damaged after its preflight verdict was cached."""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import TINY_PROFILE, tiny_overrides
from nsa.train.failures import NotRetried, failure_cause, not_retried, user_cause


def _cfg(**kw):
    from nsa.config import resolve_config
    return resolve_config(TINY_PROFILE, [f"{k.replace('__', '.')}={v}" for k, v in kw.items()])[0]


# ------------------------------------------------------------------------------------------ in the worker
@pytest.mark.parametrize("code", [errno.EROFS, errno.EPERM, errno.EACCES])
def test_run_dir_refusing_writes_is_not_retried_and_names_the_file(tmp_path, code):
    bad = OSError(code, os.strerror(code), str(tmp_path / "heartbeat_rank0.jsonl"))
    with pytest.raises(NotRetried) as e:
        with not_retried():
            raise RuntimeError("while writing the heartbeat") from bad
    line = str(e.value)
    assert "\n" not in line and line.startswith(os.strerror(code).split(" (")[0][:10])
    assert str(tmp_path / "heartbeat_rank0.jsonl") in line


def test_other_errors_pass_unchanged():
    with pytest.raises(RuntimeError, match="collective timed out"):
        with not_retried():
            raise RuntimeError("collective timed out")
    assert user_cause(OSError(errno.ECONNRESET, "Connection reset")) is None


def test_full_disk_names_the_destination_not_the_temp_source(tmp_path, monkeypatch):
    from nsa.train.checkpoint import persist_checkpoint
    src = tmp_path / "tmp_src" / "nsa_ckpt_x"
    src.mkdir(parents=True)
    (src / "checkpoint.pt").write_bytes(b"x" * 4096)
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)

    def full(*a, **k):      # what the kernel answers when the destination's filesystem is full
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "sendfile", full)
    monkeypatch.setattr(shutil, "_USE_CP_SENDFILE", True, raising=False)
    with pytest.raises(OSError) as e:
        persist_checkpoint(src, run_dir / "checkpoint_00000004")
    line = user_cause(e.value)
    assert line.startswith("No space left on device: ") and str(run_dir) in line and "tmp_src" not in line


def test_damaged_shard_names_shard_and_row_group_though_the_verdict_is_cached(tmp_path):
    from nsa.data.position import iter_local_units, plan_units, row_group_rows
    from nsa.data.shards import DataError, check_data_path, write_shards
    from nsa.data.sources import iter_source
    from nsa.data.tokenizers import get_tokenizer
    out = tmp_path / "d"
    write_shards(iter_source("local", None, max_bytes=300_000, seed=0), out, val_docs=2, shard_bytes=200_000)
    files = check_data_path(out)            # decodes and caches the clean verdict
    damage(files[0])
    assert check_data_path(out) == files    # size and mtime kept: the cached verdict still passes
    units = [u for u in plan_units(row_group_rows(files), 0, 0, 1) if u.shard == 0][:1]
    with pytest.raises(DataError) as e:
        list(iter_local_units(files, units, get_tokenizer("byte")))
    line = user_cause(e.value)
    assert "\n" not in line and line.startswith(f"{files[0]}: row group {units[0].row_group} cannot be decoded")


def damage(f: str) -> None:
    """8 KB overwritten in place, size and mtime kept (what a cached verdict cannot see)."""
    st = os.stat(f)
    with open(f, "r+b") as fh:
        fh.seek(4)
        fh.write(os.urandom(8192))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_no_batch_is_a_data_error():
    from nsa.data.shards import DataError
    from nsa.train.batches import BatchStream

    class Empty:
        def train_batches(self, epoch):
            return iter(())
    with pytest.raises(DataError, match="no batch"):
        BatchStream(Empty()).next(1)


# ------------------------------------------------------------------------------------------ the policy
def _group_error(failures):
    from ray.train.v2.api.exceptions import WorkerGroupError
    return WorkerGroupError("\n".join(map(str, failures.values())), failures)


def test_policy_raises_user_errors_at_once_and_retries_the_rest():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import FailureDecision
    from nsa.train.ray_trainer import NoRetryForUserErrors
    policy = NoRetryForUserErrors(FailureConfig(max_failures=3))
    assert policy.make_decision(_group_error({1: NotRetried("Read-only file system: /r/x")})) == FailureDecision.RAISE
    assert policy.make_decision(_group_error({0: RuntimeError("killed")})) == FailureDecision.RETRY


def test_trainer_hook_is_where_ray_builds_the_policy():
    # NsaTorchTrainer overrides this private hook: fail loudly if a Ray upgrade moves it
    import inspect
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
    assert "failure_policy=create_failure_policy" in inspect.getsource(DataParallelTrainer.fit)
    assert "failure_policy" in inspect.signature(
        __import__("ray.train.v2._internal.execution.controller", fromlist=["TrainController"]).TrainController
    ).parameters


# ------------------------------------------------------------------------------------------ driver line
def test_driver_line_is_the_workers_cause():
    err = _group_error({0: RuntimeError("gloo: connection closed"), 1: NotRetried("x.parquet: row group 3 ...")})
    assert str(err).startswith("Training failed due to worker errors")
    assert failure_cause(err, Path("/nonexistent"), _cfg()) == "x.parquet: row group 3 ..."


def test_stall_without_retries_names_the_stall_and_max_failures(tmp_path):
    from nsa.telemetry import Heartbeat
    cfg = _cfg(train__on_stall="restart", runtime__max_failures=0, train__stall_seconds=5)
    since = time.time()
    for rank in (0, 1):
        Heartbeat(tmp_path, rank=rank).write("start", 0)
    Heartbeat(tmp_path, rank=0).write("stall", 7, seconds_since_kick=5.2, exiting=True, action="restart")
    err = _group_error({0: RuntimeError("Worker health check failed: actor died")})
    line = failure_cause(err, tmp_path, cfg, since)
    assert line.startswith("a stall ended the workers") and "step 7" in line
    assert "runtime.max_failures=0" in line and "no retry left" in line and "train.on_stall=restart" in line
    # a stall before the last (re)start was retried: it is not the cause of this failure
    Heartbeat(tmp_path, rank=0).write("start", 4)
    assert not failure_cause(err, tmp_path, cfg, since).startswith("a stall")


# ------------------------------------------------------------------------------------------ before Ray
def test_read_only_storage_root_is_refused_before_ray(run_train, tiny_data, tmp_path, monkeypatch):
    import tempfile

    def read_only(*a, **k):     # as root, chmod does not stop writes: fake the read-only mount
        raise OSError(errno.EROFS, "Read-only file system", str(k.get("dir")))
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    code, err, _ = run_train(*tiny_overrides(tiny_data, "runs"), f"runtime.storage_root={tmp_path}")
    assert code == 2 and err.startswith(f"error: runtime.storage_root={tmp_path} is not writable (Read-only")
    assert not (tmp_path / "runs").exists()


def test_too_little_data_is_refused_before_ray(run_train, tiny_data, tmp_path):
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path), "train.seq_len=262144")
    first = err.splitlines()[0]
    assert code == 2 and "train tokens (manifest.json), fewer than one batch per worker" in first
    have = int(re.search(r"holds ([\d,]+) train tokens", first).group(1).replace(",", ""))
    fits = int(re.search(r"train.seq_len to <= (\d+)", first).group(1))
    assert 2 * 8 * (fits + 1) <= have < 2 * 8 * (fits + 2)      # 2 workers x batch 8 rows of fits+1 tokens


def test_out_of_memory_is_refused_before_ray(run_train, tmp_path, monkeypatch):
    import nsa.train.limits as limits
    monkeypatch.setattr(limits, "free_memory", lambda device: 16 * 2**30)
    code, err, _ = run_train(*tiny_overrides(tmp_path / "d", tmp_path), "data.source=synthetic",
                             "train.seq_len=1048576")
    first = err.splitlines()[0]
    assert code == 2 and first.startswith("error: train.seq_len=1048576 x train.batch_size=8 needs about")
    fits = int(re.search(r"use train.seq_len <= (\d+)", first).group(1))
    from nsa.launch.preflight import train_bytes
    per_worker, _ = train_bytes(_cfg(train__seq_len=fits))
    assert 2 * per_worker <= 0.9 * 16 * 2**30 < 2 * train_bytes(_cfg(train__seq_len=fits + 64))[0]
    assert train_bytes(_cfg())[0] < 2**28       # the tiny profile's own step is far below any machine


# ------------------------------------------------------------------------------------------ loopback
def _listening(pid: int) -> list[tuple[str, int]]:
    import psutil
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_rendezvous_store_and_gloo_listen_on_loopback_only():
    import torch.distributed as dist
    from nsa.train.rendezvous import bind_loopback, init_loopback_group
    before = set(_listening(os.getpid()))
    init_loopback_group("gloo", 0, 1, bind_loopback(), timeout_s=30)
    try:
        new = set(_listening(os.getpid())) - before
        assert new and all(ip == "127.0.0.1" for ip, _ in new), new
        assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    finally:
        dist.destroy_process_group()


def _loopback(ip: str) -> bool:
    import ipaddress
    a = ipaddress.ip_address(ip)
    return (a.ipv4_mapped or a).is_loopback if a.version == 6 else a.is_loopback     # ::ffff:127.0.0.1 too


def _ray_tree() -> set[int]:
    """Pids of the Ray instance this process started and everything under it (the train workers)."""
    import psutil
    import ray
    node = ray._private.worker._global_node
    pids = set()
    for infos in node.all_processes.values():
        for info in infos:
            try:
                p = psutil.Process(info.process.pid)
                pids |= {p.pid} | {c.pid for c in p.children(recursive=True)}
            except psutil.Error:
                pass
    return pids


@pytest.mark.ray
def test_damaged_shard_fails_once_naming_it_and_everything_listens_on_loopback(ray_session, tiny_data, tmp_path,
                                                                             capsys):
    import psutil
    from nsa.data.shards import check_data_path
    from nsa.launch import builder
    from nsa.config import resolve_config
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    for f in check_data_path(data):          # verdicts cached clean, then damaged under them
        if "train-" in f:
            damage(f)
    cfg, src = resolve_config(TINY_PROFILE, tiny_overrides(data, tmp_path / "runs", logging__name="dmg",
                                                          train__steps=6, runtime__max_failures=2))
    seen, stop = set(), threading.Event()

    def watch():                               # every listener of the Ray tree while the job runs
        while not stop.is_set():
            for pid in _ray_tree():
                try:
                    seen.update((ip, port, psutil.Process(pid).name()) for ip, port in _listening(pid))
                except psutil.Error:
                    pass
            time.sleep(0.2)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        out = builder.launch(cfg, src, quiet=True)
    finally:
        stop.set()
        t.join()
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("error: training failed: ")]
    assert out.exit_code == 1 and printed
    assert re.match(r"error: training failed: \S+/train-\d+-of-\d+\.parquet: row group \d+ cannot be decoded",
                    printed[0]), printed[0]
    recs = [json.loads(ln) for ln in (out.run_dir / "heartbeat_rank0.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "attempt" for r in recs) == 1          # runtime.max_failures=2, yet no retry
    outside = sorted(s for s in seen if not _loopback(s[0]))
    assert seen and not outside, outside


def test_training_loop_imports_without_ray():
    # the GPU image runs benchmarks and GPU tests through the plain loop with no Ray installed
    code = "import sys; sys.modules['ray'] = None; import nsa.train.loop, nsa.train.failures"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
