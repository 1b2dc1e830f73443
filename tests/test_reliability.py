"""Nothing lost, nothing clobbered (issue 14): one live launch per run dir, checkpoints complete or absent,
resume from the newest complete checkpoint, refused launches change nothing, and every bad input or
storage failure ends in one line. CPU, seconds each (the loop runs without Ray, as tests/test_train_loop.py)."""
from __future__ import annotations

import csv
import errno
import os
import shutil
import socket
import subprocess
import sys

import pytest

from conftest import PIPELINES, REPO, local_cfg, run_local, tiny_overrides
from nsa.config import ConfigError, resolve_config
from nsa.telemetry import read_heartbeat
from nsa.train.checkpoint import CKPT_FILE, list_checkpoints, scan_checkpoints
from nsa.train.rundir import RunLock, RunLocked, claim_run, failure_line, release_run, run_dir_under

ENV = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}


def _cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=REPO, env={**ENV, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


# ---------------------------------------------------------------------------------------------- 1: lock
def test_second_launch_exits_2_naming_the_holder(run_train, tiny_data, tmp_path):
    holder = RunLock(tmp_path / "runs" / "r").acquire()      # another live launch of the same run
    try:
        code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path / "runs"), "logging.name=r")
    finally:
        holder.release()
    line = _one_error_line(err)
    assert code == 2 and f"pid {os.getpid()}" in line and socket.gethostname() in line
    assert not (tmp_path / "runs" / "r" / "config.yaml").exists()       # nothing written by the loser


_HOLD = """
import os, sys, time
from nsa.train.rundir import RunLock
RunLock(sys.argv[1]).acquire()
print("locked", os.getpid(), flush=True)
if sys.argv[2] == "die":
    import os; os._exit(9)                     # killed: no release, the OS drops the flock
time.sleep(60)
"""


def test_lock_of_a_live_process_refuses_and_of_a_dead_one_is_taken_over(tmp_path):
    run = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(run), "live"], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().split() == ["locked", str(p.pid)]
        with pytest.raises(RunLocked, match=f"pid {p.pid} on host {socket.gethostname()}"):
            claim_run(tmp_path, "r")
    finally:
        p.kill()
        p.wait()
    died = subprocess.run([sys.executable, "-c", _HOLD, str(run), "die"], env=ENV, capture_output=True, text=True)
    assert died.returncode == 9
    dead_pid = died.stdout.split()[1]
    claim = claim_run(tmp_path, "r")
    try:
        assert any(f"stale lock of pid {dead_pid} on host" in n for n in claim.notes), claim.notes
        with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):   # now this process holds it
            RunLock(run).acquire()
    finally:
        release_run(claim.run_dir)
    RunLock(run).acquire().release()                                 # released: free again


# ---------------------------------------------------------------------------------------------- 2: disk
def _cfg(data, root, **kw):
    return local_cfg(data, root, **{"train__save_every": 2, **kw})


_run = run_local


def _losses(run_dir):
    with open(os.path.join(run_dir, "training.csv"), newline="") as fh:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(fh)}


@pytest.fixture(scope="module")
def uninterrupted(tiny_data, tmp_path_factory):
    _, rd = _run(_cfg(tiny_data, tmp_path_factory.mktemp("ref")))
    return _losses(rd)


def test_crash_inside_a_checkpoint_write_resumes_from_the_last_complete_one(tiny_data, tmp_path, monkeypatch,
                                                                            uninterrupted):
    """The disk fills while checkpoint_00000006 is written: the write fails half-way, the run fails with
    the cause, no partial directory is left, and the rerun continues from step 4 with identical losses."""
    real_copy = shutil.copyfile

    def full_disk(src, dst, *a, **k):
        if "checkpoint_00000006" in str(dst) and str(src).endswith(CKPT_FILE):
            data = open(src, "rb").read()
            with open(dst, "wb") as fh:
                fh.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real_copy(src, dst, *a, **k)

    monkeypatch.setattr(shutil, "copyfile", full_disk)
    with pytest.raises(OSError) as e:
        _run(_cfg(tiny_data, tmp_path))
    monkeypatch.undo()
    assert failure_line(e.value).startswith("No space left on device: ")
    rd = tmp_path / "r"
    assert [s for s, _ in list_checkpoints(rd)] == [2, 4]
    assert not [p for p in os.listdir(rd) if "checkpoint_00000006" in p]     # complete or absent
    s, _ = _run(_cfg(tiny_data, tmp_path))
    assert s["status"] == "completed" and s["start_step"] == 4 and s["step"] == 8
    got = _losses(rd)
    assert sorted(got) == list(range(1, 9))                                   # nothing lost or doubled
    for step in range(5, 9):
        assert got[step] == uninterrupted[step], step                        # bit-identical continuation


def test_partial_checkpoint_dir_is_skipped_named_and_replaced(tiny_data, tmp_path, capsys, uninterrupted):
    """A checkpoint dir copied in part by other code (Ray's own upload, a killed copy): resume skips it,
    says which and why, continues from the one before with identical losses, and writes the step anew."""
    s, rd = _run(_cfg(tiny_data, tmp_path, runtime__fault="halt@6"))
    assert s["checkpoints"] == [2, 4, 6]
    os.remove(os.path.join(rd, ".HALT"))
    f = os.path.join(rd, "checkpoint_00000006", CKPT_FILE)
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size // 3)
    capsys.readouterr()
    s, _ = _run(_cfg(tiny_data, tmp_path, runtime__fault="halt@6"))
    out = capsys.readouterr().out
    assert f"resume: skipped checkpoint_00000006: checkpoint.pt has {size // 3} of {size} bytes" in out
    assert s["start_step"] == 4 and s["status"] == "completed"
    start = next(r for r in read_heartbeat(os.path.join(rd, "heartbeat_rank0.jsonl"))
                 if r["kind"] == "start" and r["step"] == 4)
    assert "checkpoint_00000006" in start["skipped_checkpoints"][0]
    got = _losses(rd)
    for step in range(5, 9):
        assert got[step] == uninterrupted[step], step
    good, partial = scan_checkpoints(rd)
    assert [st for st, _ in good] == [2, 4, 6, 8] and not partial
    assert [p for p in os.listdir(rd) if p.startswith(".incomplete-checkpoint_00000006")]


def _ckpt(run_dir, step):
    from test_pipeline_cli import _ckpt as make      # a small real checkpoint (1 layer x 32)
    return make(run_dir, f"checkpoint_{step:08d}", step)


def _small_cfg(root, **kw):
    over = {"logging.root": str(root), "logging.name": "r", "model.n_layers": 1, "model.dim": 32, "nsa.l": 16,
            "nsa.d": 8, "nsa.l_sel": 16, "nsa.n_sel": 2, "nsa.w": 32, "data.source": "synthetic", **kw}
    return resolve_config(None, [f"{k}={v}" for k, v in over.items()], env={})[0]


def test_driver_resumes_from_newest_complete_and_sets_the_partial_aside(tmp_path, capsys):
    from nsa.launch import builder
    run = tmp_path / "r"
    _ckpt(run, 3)
    f5 = _ckpt(run, 5)
    f5.write_bytes(f5.read_bytes()[:5000])                   # the disk filled while this one was written
    cfg = _small_cfg(tmp_path)
    rd = builder.prepare_run(cfg, commit=False)
    try:
        out = capsys.readouterr().out
        assert "skipping checkpoint_00000005: checkpoint.pt has 5000 of" in out
        assert "continuing from step 3 (checkpoint_00000003)" in out
        assert f5.exists()                                   # nothing changed before commit
        builder.commit_prepared(rd, cfg)
        assert not f5.parent.exists() and [s for s, _ in list_checkpoints(rd)] == [3]
        assert "set the incomplete checkpoint_00000005" in capsys.readouterr().out
    finally:
        release_run(rd)


_FSIZE = """
import os, resource, signal, sys
from pathlib import Path
from nsa.train.reporting import write_json
from nsa.train.rundir import failure_line
p = Path(sys.argv[1])
write_json(p, {"status": "old"})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)            # EFBIG instead of the signal
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
try:
    write_json(p, {"blob": "x" * 10000})
except OSError as e:
    print(failure_line(e))
"""


def test_rewritten_files_survive_a_write_that_runs_out_of_room(tmp_path):
    f = tmp_path / "metrics.json"
    r = _cli("-c", _FSIZE, str(f))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("File too large")
    assert f.read_text().replace(" ", "").replace("\n", "") == '{"status":"old"}'   # the old file, whole
    assert os.listdir(tmp_path) == ["metrics.json"]                                   # no temp left


def test_failure_line_names_the_storage_cause():
    text = ("ControllerError: Training failed due to worker errors:\n  rank 0: Traceback ...\n"
            "OSError: [Errno 28] No space left on device: '/runs/r/checkpoint_00000020'\n")
    assert failure_line(RuntimeError(text)) == "No space left on device: /runs/r/checkpoint_00000020"
    try:
        try:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/runs/r/config.yaml")
        except OSError as inner:
            raise RuntimeError("ControllerError") from inner
    except RuntimeError as outer:
        assert failure_line(outer) == "Read-only file system: /runs/r/config.yaml"
    assert failure_line(RuntimeError("x\nnsa.data.shards.DataError: /d/a.parquet: row group 2 of 4 cannot be "
                                     "decoded")) == "/d/a.parquet: row group 2 of 4 cannot be decoded"


def test_storage_error_in_the_driver_is_one_line(capsys):
    from nsa.launch import cli as _cli

    def main():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/r/config.yaml")

    with pytest.raises(SystemExit) as e:
        _cli.guarded(main)()
    assert e.value.code == 1
    assert _one_error_line(capsys.readouterr().err) == "error: No space left on device: /runs/r/config.yaml"


# ---------------------------------------------------------------------------------------------- 3: names
@pytest.mark.parametrize("name", ["..", ".", "a/b", "../x", " r"])
def test_run_name_is_one_plain_component(run_train, tiny_data, tmp_path, name):
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path / "runs"), f"logging.name={name}")
    assert code == 2 and "logging.name=" in _one_error_line(err)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_run_name_through_a_symlink_out_of_the_root_is_refused(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "root" / "r")
    with pytest.raises(ConfigError, match="outside logging.root"):
        run_dir_under(tmp_path / "root", "r")


# ---------------------------------------------------------------------------------------------- 4: refused
def test_refused_launch_changes_nothing_in_an_existing_run(run_train, tiny_data, tmp_path, monkeypatch):
    from nsa.launch import cli as _cli
    from nsa.launch import builder
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("original\n")
    (run / ".HALT").write_text("from an earlier halt\n")
    monkeypatch.setattr(builder, "connect_ray", lambda cfg: "ray: (test) not started")
    monkeypatch.setattr(builder, "make_datasets", lambda cfg: {})

    def refuse(cfg, run_dir, datasets, **kw):   # check_resources' verdict on a 2-CPU machine
        raise _cli.UserError("runtime.num_workers=8 x runtime.cpus_per_worker=0.5 needs 4 CPU, the Ray cluster "
                             "has 2: lower runtime.num_workers or runtime.cpus_per_worker")

    monkeypatch.setattr(builder, "build_trainer", refuse)
    before = sorted(os.listdir(run))
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path / "runs"), "logging.name=r",
                             "runtime.num_workers=8")
    assert code == 2 and "runtime.num_workers=8" in _one_error_line(err)
    assert (run / "config.yaml").read_text() == "original\n"
    assert (run / ".HALT").exists() and sorted(os.listdir(run)) == before
    RunLock(run).acquire().release()             # the refused launch let go of the run


# ---------------------------------------------------------------------------------------------- 5, 7, 8: config
def test_scientific_notation_everywhere(tmp_path):
    prof = tmp_path / "p.yaml"
    prof.write_text("train:\n  lr: 1e-3\n  weight_decay: 1E-2\n")
    assert resolve_config(None, ["train.lr=1e-3"], env={})[0].train.lr == 1e-3
    cfg, src = resolve_config(str(prof), [], env={})
    assert (cfg.train.lr, cfg.train.weight_decay) == (1e-3, 1e-2) and src["train.lr"].startswith("yaml:")
    assert resolve_config(None, [], env={"NSA_LR": "1e-3"})[0].train.lr == 1e-3
    assert resolve_config(None, ["train.steps=1e3"], env={})[0].train.steps == 1000


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_non_finite_floats_are_rejected(tmp_path, value):
    with pytest.raises(ConfigError, match="train.lr=.* must be a finite number"):
        resolve_config(None, [f"train.lr={value}"], env={})
    prof = tmp_path / "p.yaml"
    prof.write_text(f"train:\n  stall_seconds: {value}\n")
    with pytest.raises(ConfigError, match="train.stall_seconds=.* must be a finite number"):
        resolve_config(str(prof), [], env={})


@pytest.mark.parametrize("var, value", [("NSA_TB_DISABLE", "maybe"), ("NSA_USE_TRITON_SEL", "banana"),
                                        ("NSA_DETECT_ANOMALY", "2")])
def test_booleans_accept_only_documented_spellings(var, value):
    with pytest.raises(ConfigError, match=rf"\${var}='{value}' is not a boolean"):
        resolve_config(None, [], env={var: value})
    with pytest.raises(ConfigError, match="logging.csv='maybe' is not a boolean"):
        resolve_config(None, ["logging.csv=maybe"], env={})
    for spelling, want in (("1", "triton"), ("off", "torch"), ("Yes", "triton"), ("false", "torch")):
        assert resolve_config(None, [], env={"NSA_USE_TRITON_SEL": spelling})[0].nsa.backend == want


def test_retired_variables_and_empty_profiles_are_said(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here yet\n")
    cfg, _ = resolve_config(str(empty), [], env={"NSA_SEL_RANGES_V2": "1", "NSA_FORCE_PARITY": "0"})
    err = capsys.readouterr().err
    assert "warning: NSA_SEL_RANGES_V2 is retired and ignored" in err
    assert "warning: NSA_FORCE_PARITY is retired and ignored" in err
    assert f"warning: profile {empty} is empty: every field keeps its default" in err
    assert cfg.train.steps == 300


def test_yaml_syntax_error_and_unparsable_env_are_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {steps: 3\nmodel: {dim: 64}\n")
    r = _cli(str(PIPELINES / "train.py"), "--config", str(bad), "--print-config")
    assert r.returncode == 2 and f"{bad}: YAML syntax error at line" in _one_error_line(r.stderr)
    r = _cli(str(PIPELINES / "train.py"), "--print-config", env={"NSA_LR": "[1"})
    assert r.returncode == 2 and "$NSA_LR='[1' cannot be parsed for train.lr" in _one_error_line(r.stderr)
    r = _cli(str(PIPELINES / "train.py"), "--print-config", "train.lr=1e-3", env={"NSA_SEL_RANGES_V2": "1"})
    assert r.returncode == 0 and "0.001" in r.stdout
    assert "warning: NSA_SEL_RANGES_V2 is retired and ignored" in r.stderr


def test_generate_bounds_max_new_tokens_before_allocating(tmp_path):
    from test_pipeline_cli import _ckpt as make
    f = make(tmp_path)
    r = _cli(str(PIPELINES / "generate.py"), "--checkpoint", str(f.parent), "--max-new-tokens", "1000000000000")
    line = _one_error_line(r.stderr)
    assert r.returncode == 2 and "--max-new-tokens=1000000000000 needs about" in line and "use --max-new-tokens <=" in line


def test_smoke_rejects_bad_phase1_steps_before_phase0(tmp_path):
    r = _cli(str(PIPELINES / "smoke.py"), "--phase1-steps", "-3", f"logging.root={tmp_path}")
    assert r.returncode == 2 and "--phase1-steps=-3 must be >= 1" in _one_error_line(r.stderr)
    assert "Phase 0" not in r.stdout and not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- 6: shards
def _corrupt_mid_file(f):
    data = bytearray(f.read_bytes())
    mid = len(data) // 5                     # inside the text column's pages; the footer stays intact
    data[mid:mid + 2000] = bytes((b ^ 0x5A) for b in data[mid:mid + 2000])
    f.write_bytes(bytes(data))


def test_preflight_decodes_each_shard_once_and_names_the_row_group(tiny_data, tmp_path, monkeypatch):
    from nsa.data import shards
    data = tmp_path / "d"
    shutil.copytree(tiny_data, data)
    (data / shards.MANIFEST).unlink()                                # no manifest: no checksum to catch it
    calls = []
    real = shards.decode_shard
    monkeypatch.setattr(shards, "decode_shard", lambda f, pf=None: (calls.append(str(f)), real(f, pf))[1])
    files = shards.check_data_path(data)
    assert len(calls) == len(files)                                  # first sight: every shard decoded
    calls.clear()
    assert shards.check_data_path(data) == files and calls == []     # relaunch: metadata only
    bad = data / os.path.basename(files[0])
    _corrupt_mid_file(bad)                                           # new size/mtime -> decoded again
    with pytest.raises(ValueError, match=rf"{bad}: row group 0 of 1 cannot be decoded"):
        shards.check_data_path(data)
    assert calls == [str(bad)]
    assert shards.diagnose_data_error(data).startswith(f"{bad}: row group 0 of 1")


def test_manifest_checksums_are_verified_once(tiny_data, tmp_path, monkeypatch):
    from nsa.data import shards
    data = tmp_path / "d"
    shutil.copytree(tiny_data, data)
    hashed = []
    real = shards.sha256_file
    monkeypatch.setattr(shards, "sha256_file", lambda f, *a: (hashed.append(f), real(f, *a))[1])
    files = shards.check_data_path(data)
    assert len(hashed) == len(files)
    hashed.clear()
    shards.check_data_path(data)
    assert hashed == []


# ---------------------------------------------------------------------------------------------- 9: ray bind
def test_local_ray_is_started_on_loopback(monkeypatch):
    from nsa.launch import builder
    import ray
    from ray._private import ray_constants
    seen = {}

    def fake_init(**kw):
        seen.update(kw, cluster_mode=ray_constants.ENABLE_RAY_CLUSTER)

    before = ray_constants.ENABLE_RAY_CLUSTER
    monkeypatch.setattr(ray, "init", fake_init)
    builder.start_local_ray(num_cpus=1)
    assert seen["_node_ip_address"] == "127.0.0.1" and seen["cluster_mode"] is False
    assert ray_constants.ENABLE_RAY_CLUSTER == before                # restored after init


@pytest.mark.ray
def test_local_ray_listens_on_loopback_only(ray_session):
    psutil = pytest.importorskip("psutil")
    ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    addrs = {c.laddr.ip for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.pid in ours}
    assert addrs, "no listening socket of this process tree found"
    assert addrs <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, addrs


# ---------------------------------------------------------------------------------------------- NaN step
def test_nan_is_reported_at_the_step_it_happened(tiny_data, tmp_path):
    s, rd = _run(_cfg(tiny_data, tmp_path, runtime__fault="nan@3", logging__log_every=5, train__save_every=0))
    anomaly = [r for r in read_heartbeat(os.path.join(rd, "heartbeat_rank0.jsonl")) if r["kind"] == "anomaly"]
    assert len(anomaly) == 1 and anomaly[0]["step"] == 3 and anomaly[0]["detected_at"] == 5
    assert s["status"] == "anomaly" and s["first_nonfinite_step"] == 3 and "at step 3" in s["reason"]

