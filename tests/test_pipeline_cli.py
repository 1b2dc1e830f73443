"""Entry points' user-facing behaviour: bad inputs fail before any worker starts, with exit code 2 and one
line naming the field or file; --help lists the keys; generate.py decodes from a checkpoint."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import PIPELINES, REPO, tiny_overrides

ENV = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": "disabled"}


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_unknown_key_exits_2_without_traceback():
    r = _cli(str(PIPELINES / "train.py"), "train.stepz=3")
    assert r.returncode == 2
    assert "unknown config key 'train.stepz'" in r.stderr and "did you mean 'steps'" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_every_config_key():
    r = _cli(str(PIPELINES / "train.py"), "--help")
    assert r.returncode == 0
    for key in ("train.steps", "runtime.num_workers", "nsa.l_sel", "logging.mlflow_uri", "data.auto_prepare"):
        assert key in r.stdout


def _ckpt(tmp_path, name="ck", step=3):
    from nsa.config import RunConfig
    from nsa.model import TinyLM
    from nsa.train.checkpoint import build_state, save_checkpoint
    from nsa.train.precision import setup_precision
    from nsa.train.schedule import build_optimizer, build_scheduler
    cfg = RunConfig()
    cfg.model.n_layers, cfg.model.dim = 1, 32
    cfg.nsa.l, cfg.nsa.d, cfg.nsa.l_sel, cfg.nsa.n_sel, cfg.nsa.w = 16, 8, 16, 2, 32
    m = TinyLM.from_config(cfg.model, cfg.nsa)
    opt = build_optimizer(m, cfg.train)
    st = build_state(model=m, optimizer=opt, scheduler=build_scheduler(opt, cfg.train),
                     scaler=setup_precision("fp32", torch.device("cpu")).scaler, step=step,
                     data={"epoch": 0, "batches_in_epoch": 0, "samples_seen": 0}, config=cfg.to_dict())
    return save_checkpoint(tmp_path / name, st)


@pytest.mark.parametrize("bad, message", [
    (["nsa.d=5"], "nsa.d=5 must divide nsa.l=16"),
    (["train.seq_len=8"], "train.seq_len=8 is shorter than nsa.l=16"),
    (["runtime.precision=fp16"], "fp16 needs GPUs"),
    (["data.path=/nonexistent/shards"], "'/nonexistent/shards' does not exist"),
])
def test_bad_config_or_data_path(run_train, tiny_data, tmp_path, bad, message):
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path), *bad)
    assert code == 2 and message in err, err


def test_empty_data_dir(run_train, tiny_data, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path), f"data.path={empty}")
    assert code == 2 and "no train parquet files" in err


def test_corrupt_parquet_shard_is_named(run_train, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    shard = sorted(data.glob("train-*.parquet"))[0]
    shard.write_bytes(b"PAR1 this is not parquet" * 10)
    code, err, _ = run_train(*tiny_overrides(data, tmp_path))
    assert code == 2 and shard.name in err, err


def test_corrupt_resume_from_checkpoint_is_named(run_train, tiny_data, tmp_path):
    f = _ckpt(tmp_path)
    f.write_bytes(f.read_bytes()[:1000])
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path), f"train.resume_from={f.parent}")
    assert code == 2 and str(f) in err and "corrupt" in err


def test_missing_resume_from(run_train, tiny_data, tmp_path):
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path), f"train.resume_from={tmp_path / 'nope'}")
    assert code == 2 and "does not exist" in err


def test_corrupt_latest_checkpoint_of_a_named_run_is_never_overwritten(run_train, tiny_data, tmp_path):
    run = tmp_path / "runs" / "r"
    f = _ckpt(run, "checkpoint_00000003")
    garbage = b"g" * f.stat().st_size     # complete (the size meta.json records) but unreadable: corrupt,
    f.write_bytes(garbage)                # not a partial write (those are skipped: tests/test_reliability.py)
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path / "runs"), "logging.name=r")
    assert code == 2 and str(f) in err
    assert f.read_bytes() == garbage


def test_resume_never_refuses_existing_run(run_train, tiny_data, tmp_path):
    _ckpt(tmp_path / "runs" / "r", "checkpoint_00000003")
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path / "runs"), "logging.name=r", "train.resume=never")
    assert code == 2 and "train.resume=never" in err


def test_model_shape_mismatch_on_resume(run_train, tiny_data, tmp_path):
    f = _ckpt(tmp_path)
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path), f"train.resume_from={f.parent}")
    assert code == 2 and "model.dim: checkpoint 32, config 128" in err


def test_generate_from_checkpoint(tmp_path):
    f = _ckpt(tmp_path)
    r = _cli(str(PIPELINES / "generate.py"), "--checkpoint", str(f.parent), "--prompt", "Hello NSA!",
             "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "20")
    assert r.returncode == 0, r.stderr
    assert "generated 6 tokens" in r.stdout and "Hello NSA!" in r.stdout and "step 3" in r.stdout
    bad = _cli(str(PIPELINES / "generate.py"), "--checkpoint", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "does not exist" in bad.stderr and "Traceback" not in bad.stderr
