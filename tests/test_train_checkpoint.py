"""Checkpoint roundtrip with torch.load(weights_only=True), never-overwrite, corrupt-file errors."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from nsa.config import RunConfig
from nsa.model import TinyLM
from nsa.train.checkpoint import (CKPT_FILE, CheckpointError, build_state, checkpoint_dir_name,
                                  list_checkpoints, load_checkpoint, resolve_checkpoint_file,
                                  restore_training_state, save_checkpoint, verify_checkpoint)
from nsa.train.precision import setup_precision
from nsa.train.schedule import build_optimizer, build_scheduler
from nsa.train.step import train_step

TINY = dict(vocab=256, dim=32, n_layers=1, n_heads=2, n_kv_groups=1, d_k=16, d_v=16, l=8, d=4, l_sel=8,
            n_sel=2, w=16, backend="torch")


class _T:
    lr, beta1, beta2, weight_decay, warmup_steps, steps, min_lr_ratio = 1e-2, 0.9, 0.95, 0.1, 2, 10, 0.1


def _setup(seed=0):
    torch.manual_seed(seed)
    m = TinyLM(**TINY)
    opt = build_optimizer(m, _T)
    return m, opt, build_scheduler(opt, _T), setup_precision("fp32", torch.device("cpu"))


def _batch(seed):
    return torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(seed))


def _state(m, opt, sched, prec, step):
    return build_state(model=m, optimizer=opt, scheduler=sched, scaler=prec.scaler, step=step,
                       data={"epoch": 1, "batches_in_epoch": 3, "samples_seen": 48},
                       config=RunConfig().to_dict(), metrics={"loss": 2.5})


def test_roundtrip_weights_only_continues_identically(tmp_path):
    m, opt, sched, prec = _setup()
    for s in range(3):
        train_step(m, [_batch(s)], opt, sched, prec, grad_clip=1.0)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    save_checkpoint(tmp_path / checkpoint_dir_name(3), _state(m, opt, sched, prec, 3))
    # raw torch.load with weights_only=True must work (no pickled classes inside)
    raw = torch.load(tmp_path / checkpoint_dir_name(3) / CKPT_FILE, weights_only=True)
    assert raw["step"] == 3 and raw["data"]["samples_seen"] == 48
    assert raw["config"]["train"]["steps"] == RunConfig().train.steps
    expect_rand = (random.random(), float(np.random.rand()), torch.rand(1))
    lr_at_save = opt.param_groups[0]["lr"]
    ref = train_step(m, [_batch(3)], opt, sched, prec, grad_clip=1.0)   # the uninterrupted next step

    m2, opt2, sched2, prec2 = _setup(seed=123)                            # different init
    state = load_checkpoint(tmp_path)                                     # run dir -> latest
    assert restore_training_state(state, model=m2, optimizer=opt2, scheduler=sched2,
                                  scaler=prec2.scaler) == 3
    assert (random.random(), float(np.random.rand())) == expect_rand[:2]
    assert torch.equal(torch.rand(1), expect_rand[2])
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(lr_at_save)
    got = train_step(m2, [_batch(3)], opt2, sched2, prec2, grad_clip=1.0)
    assert torch.allclose(got.loss, ref.loss, atol=1e-6)
    for p, q in zip(m.parameters(), m2.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_never_overwrites(tmp_path):
    m, opt, sched, prec = _setup()
    d = tmp_path / checkpoint_dir_name(1)
    save_checkpoint(d, _state(m, opt, sched, prec, 1))
    before = (d / CKPT_FILE).read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        save_checkpoint(d, _state(m, opt, sched, prec, 2))
    assert (d / CKPT_FILE).read_bytes() == before


def test_latest_by_step_and_resolution(tmp_path):
    m, opt, sched, prec = _setup()
    for s in (2, 10, 5):
        save_checkpoint(tmp_path / checkpoint_dir_name(s), _state(m, opt, sched, prec, s))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 5, 10]
    assert resolve_checkpoint_file(tmp_path).parent.name == checkpoint_dir_name(10)
    assert verify_checkpoint(tmp_path / checkpoint_dir_name(5))[1] == 5


@pytest.mark.parametrize("damage", ["garbage", "truncate", "empty"])
def test_corrupt_checkpoint_names_the_file(tmp_path, damage):
    m, opt, sched, prec = _setup()
    f = save_checkpoint(tmp_path / "checkpoint_00000001", _state(m, opt, sched, prec, 1))
    data = f.read_bytes()
    f.write_bytes({"garbage": b"not a checkpoint" * 10, "truncate": data[: len(data) // 2], "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=str(f)):
        load_checkpoint(f.parent)
    with pytest.raises(CheckpointError, match=str(f)):
        verify_checkpoint(tmp_path)


def test_missing_and_foreign_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint_file(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="no checkpoint.pt"):
        resolve_checkpoint_file(tmp_path)
    foreign = tmp_path / "x.pt"
    torch.save({"weights": torch.ones(2)}, foreign)
    with pytest.raises(CheckpointError, match="lacks keys"):
        load_checkpoint(foreign)
