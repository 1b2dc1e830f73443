"""runtime.context_parallel (issue 49, item 3): context parallelism through the training loop, on CPU over gloo.

Each rank is a spawned process with its own LocalEnv(rank, world_size) (no Ray), a one-layer dim-64 NSA
model on 62-token rows: at CP=2 chunks of 16 positions, so rank 0 holds two positions of padding (labels
-100) and chunk boundaries cut compression blocks (l=16, d=8) and the window (w=24). Every rank logs its
replica's loss (the CP group's shares summed), so each rank's loss of a step must be the one-process run's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import local_cfg
from nsa.config import ConfigError, config_from_dict, resolve_config
from nsa.telemetry import read_heartbeat
from nsa.train.checkpoint import load_checkpoint
from test_fsdp import _free_port

STEPS, SAVE = 6, 3


class _Unseekable:
    """LocalEnv as data that cannot seek (Ray's split synthetic data): each rank reads its own stream of
    ``streams`` and the loop must take the CP group's first rank's batches."""

    def __init__(self, env, streams: int) -> None:
        self.env, self.streams = env, streams

    def train_batches(self, epoch: int):
        return iter(self.env.train_stream(epoch, None, rank=self.env.rank % self.streams, world=self.streams))

    def __getattr__(self, name):
        if name in ("seekable", "train_stream"):
            raise AttributeError(name)
        return getattr(self.env, name)


def _worker(rank: int, world: int, port: int, cfg_dict: dict, run_dir: str, resume_from: str | None,
            unseekable: int) -> None:
    import torch.distributed as dist
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import run_training
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = config_from_dict(cfg_dict)
        env = LocalEnv(cfg, run_dir, rank=rank, world_size=world)
        run_training(cfg, run_dir, _Unseekable(env, unseekable) if unseekable else env, resume_from=resume_from)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _train(cfg, world: int, resume_from: Path | None = None, unseekable: int = 0) -> Path:
    run_dir = os.path.join(cfg.logging.root, cfg.logging.name)
    args = (world, _free_port(), cfg.to_dict(), run_dir, str(resume_from) if resume_from else None, unseekable)
    if world == 1:
        _worker(0, *args)
    else:
        mp.spawn(_worker, args=args, nprocs=world, join=True)
    return Path(run_dir)


def _rank_losses(run_dir: Path, rank: int) -> dict[int, tuple[float, float]]:
    """step -> (loss, grad norm) of that step as rank `rank` logged it (log_every=1)."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_heartbeat(run_dir / f"heartbeat_rank{rank}.jsonl")
            if r["kind"] == "step_end" and r.get("loss_step") == r["step"]}


def _cfg(data, root, name, cp: int = 1, **kw):
    kw.setdefault("runtime__num_workers", 2)
    return local_cfg(data, root, logging__name=name, train__steps=STEPS, train__eval_batches=1, train__lr=1e-2,
                     train__seq_len=62, nsa__w=24, logging__stats_every=2, runtime__context_parallel=cp, **kw)


def _assert_same(got: dict, ref: dict, steps) -> None:
    assert sorted(got) == list(steps)
    for s in got:
        assert got[s][0] == pytest.approx(ref[s][0], rel=1e-5), ("loss", s)
        assert got[s][1] == pytest.approx(ref[s][1], rel=1e-4), ("grad norm", s)


@pytest.fixture(scope="module")
def single_run(tiny_data, tmp_path_factory):
    return _train(_cfg(tiny_data, tmp_path_factory.mktemp("one"), "one"), 1)


@pytest.fixture(scope="module")
def cp_run(tiny_data, tmp_path_factory):
    """One uninterrupted CP=2 run on 2 processes (one replica), checkpointing at step SAVE and at the end."""
    return _train(_cfg(tiny_data, tmp_path_factory.mktemp("cp"), "cp2", cp=2, train__save_every=SAVE,
                       runtime__cuda_graph=True), 2)


def test_cp2_losses_equal_single_process(single_run, cp_run):
    ref = _rank_losses(single_run, 0)
    for rank in (0, 1):
        _assert_same(_rank_losses(cp_run, rank), ref, range(1, STEPS + 1))
    assert ref[STEPS][0] < ref[1][0]                                  # it trains
    one, two = (json.loads((d / "metrics.json").read_text()) for d in (single_run, cp_run))
    assert two["final_val_loss"] == pytest.approx(one["final_val_loss"], rel=1e-5)
    assert two["context_parallel"] == 2
    assert two["step_mode"].startswith("eager (runtime.cuda_graph: runtime.context_parallel=2: ")
    # the global batch counts are the replica's: one stream, the single-process run's tokens
    assert two["tokens_seen_this_session"] == one["tokens_seen_this_session"]
    assert two["data_position"] == one["data_position"]
    state = load_checkpoint(cp_run / f"checkpoint_{SAVE:08d}")
    assert len(state["data"]["ranks"]) == 1                          # one data stream per replica


@pytest.mark.parametrize("world,sharding", [(1, "ddp"), (2, "fsdp")])
def test_cp2_checkpoint_resumes_with_the_same_losses(tiny_data, tmp_path, single_run, cp_run, world, sharding):
    """The CP=2 run's checkpoint at step SAVE continues on 1 process (CP off), or under CP=2 with FSDP2
    over both ranks (its gradient mean over all ranks is DDP's), with the single-process run's losses."""
    ref = _rank_losses(single_run, 0)
    cfg = _cfg(tiny_data, tmp_path, f"resume{world}", cp=world, runtime__sharding=sharding)
    run = _train(cfg, world, resume_from=cp_run / f"checkpoint_{SAVE:08d}")
    for rank in range(world):
        _assert_same(_rank_losses(run, rank), ref, range(SAVE + 1, STEPS + 1))
    summary = json.loads((run / "metrics.json").read_text())
    assert (summary["sharding"], summary["context_parallel"], summary["start_step"]) == (sharding, world, SAVE)


def test_dp2_x_cp2_equals_plain_data_parallel(tiny_data, tmp_path):
    """4 processes, two replicas of CP=2 (groups {0,1}, {2,3}): each replica's losses are those of the
    same replica in a 2-process DDP run, and the weights after the run are the DDP run's (the gradient
    average over all 4 ranks of shares x 2 is the mean over replicas)."""
    ddp = _train(_cfg(tiny_data, tmp_path, "ddp"), 2)
    cp = _train(_cfg(tiny_data, tmp_path, "dpcp", cp=2, runtime__num_workers=4), 4)
    for rank in range(4):
        _assert_same(_rank_losses(cp, rank), _rank_losses(ddp, rank // 2), range(1, STEPS + 1))
    # compared over the whole model: AdamW turns rounding-level gradients (phi's output bias, which softmax
    # ignores; rare tokens' embedding rows) into steps of their own, so single tensors differ more
    a, b = (torch.cat([t.flatten() for t in load_checkpoint(d / f"checkpoint_{STEPS:08d}")["model"].values()])
            for d in (ddp, cp))
    assert (a - b).norm() <= 1e-5 * a.norm()
    assert (a - b).abs().max() <= 1e-5


def test_unseekable_data_is_broadcast_from_the_group_leader(tiny_data, tmp_path):
    """Data that cannot seek: each rank reads a different stream, CP=2 trains on rank 0's; the reference
    is one process reading that same stream (stream 0 of 2), fast-forwarded alike on resume."""
    ref = _rank_losses(_train(_cfg(tiny_data, tmp_path, "ref"), 1, unseekable=2), 0)
    run = _train(_cfg(tiny_data, tmp_path, "bcast", cp=2, train__save_every=SAVE), 2, unseekable=2)
    for rank in (0, 1):
        _assert_same(_rank_losses(run, rank), ref, range(1, STEPS + 1))


def test_config_errors():
    def bad(match, *over):
        with pytest.raises(ConfigError, match=match):
            resolve_config(None, list(over), env={})
    bad("runtime.context_parallel=0 must be >= 1", "runtime.context_parallel=0")
    bad(r"runtime.num_workers=3 is not a multiple of runtime.context_parallel=2: use runtime.num_workers=2",
        "runtime.context_parallel=2", "runtime.num_workers=3")
    bad("runtime.context_parallel=2 needs 2 or a multiple of 2 Ray workers: runtime.num_workers=0",
        "runtime.context_parallel=2", "runtime.num_workers=0")
    bad("runtime.context_parallel=2 needs model.attention=nsa", "runtime.context_parallel=2", "model.attention=dense")
    bad("train.seq_len=32 is shorter than runtime.context_parallel=64", "runtime.context_parallel=64",
        "runtime.num_workers=64", "train.seq_len=32")
    cfg = resolve_config(None, ["runtime.context_parallel=2", "runtime.num_workers=4"], env={})[0]
    assert cfg.runtime.context_parallel == 2
    assert resolve_config(None, ["runtime.context_parallel=2", "runtime.num_workers=-1"], env={})[0]


def test_world_size_not_a_multiple_is_refused_at_start():
    from nsa.train.cp import ContextParallel, cp_groups
    assert cp_groups(6, 2) == [[0, 1], [2, 3], [4, 5]] and cp_groups(4, 4) == [[0, 1, 2, 3]]
    from nsa.train.failures import NotRetried
    with pytest.raises(NotRetried, match=r"runtime.context_parallel=2 must divide the world size 3"):
        ContextParallel(2, 0, 3, 64, torch.device("cpu"))
    one = ContextParallel(1, 1, 2, 64, torch.device("cpu"))
    assert (one.dp, one.dp_rank, one.graph_reason(), one.streams([1, 2])) == (2, 1, None, [1, 2])
