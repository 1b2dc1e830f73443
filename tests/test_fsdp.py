"""runtime.sharding=fsdp (issue 49, item 2): FSDP2 through the same loop, on CPU processes over gloo.

Runs without Ray: each rank is a spawned process with its own LocalEnv(rank, world_size) over a loopback
gloo group, a one-layer dim-64 model on 64-token rows. Losses come from each rank's step_end heartbeats
(the step's own loss with logging.log_every=1); the global loss of a step is the mean over ranks."""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import PIPELINES, local_cfg
from nsa.config import ConfigError, config_from_dict, resolve_config
from nsa.telemetry import read_heartbeat
from nsa.train.checkpoint import (checkpoint_problem, list_checkpoints, load_checkpoint, load_model_weights,
                                  prune_checkpoints, verify_checkpoint)

STEPS, SAVE = 6, 3


def _worker(rank: int, world: int, port: int, cfg_dict: dict, run_dir: str, resume_from: str | None) -> None:
    import torch.distributed as dist
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import run_training
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        cfg = config_from_dict(cfg_dict)
        run_training(cfg, run_dir, LocalEnv(cfg, run_dir, rank=rank, world_size=world), resume_from=resume_from)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(cfg, world: int, resume_from: Path | None = None) -> Path:
    run_dir = os.path.join(cfg.logging.root, cfg.logging.name)
    args = (world, _free_port(), cfg.to_dict(), run_dir, str(resume_from) if resume_from else None)
    if world == 1:
        _worker(0, *args)
    else:
        mp.spawn(_worker, args=args, nprocs=world, join=True)
    return Path(run_dir)


def _losses(run_dir: Path, world: int) -> dict[int, float]:
    """step -> the mean over ranks of each rank's loss of that step."""
    per = [{r["step"]: r["loss"] for r in read_heartbeat(run_dir / f"heartbeat_rank{k}.jsonl")
            if r["kind"] == "step_end" and r.get("loss_step") == r["step"]} for k in range(world)]
    return {s: sum(p[s] for p in per) / world for s in per[0]}


def _cfg(data, root, name, **kw):
    return local_cfg(data, root, logging__name=name, train__steps=STEPS, train__eval_batches=1, train__lr=1e-2,
                     **kw)


@pytest.fixture(scope="module")
def ddp_run(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    return _train(_cfg(tiny_data, root, "ddp2", train__save_every=SAVE), 2)


@pytest.fixture(scope="module")
def fsdp_run(tiny_data, tmp_path_factory):
    """One uninterrupted 2-process FSDP run, checkpointing at step SAVE and at the end."""
    root = tmp_path_factory.mktemp("fsdp")
    return _train(_cfg(tiny_data, root, "fsdp2", runtime__sharding="fsdp", train__save_every=SAVE), 2)


def test_fsdp_losses_equal_ddp(ddp_run, fsdp_run):
    ddp = _losses(ddp_run, 2)
    fsdp = _losses(fsdp_run, 2)
    assert sorted(ddp) == sorted(fsdp) == list(range(1, STEPS + 1))
    assert ddp[1] == pytest.approx(fsdp[1], rel=1e-6)      # same init on every rank, same first batch
    for s in ddp:
        assert fsdp[s] == pytest.approx(ddp[s], rel=1e-5), s
    assert ddp[STEPS] < ddp[1]                               # it trains


def test_sharded_checkpoint_is_complete_listed_and_checked(fsdp_run):
    steps = [s for s, _ in list_checkpoints(fsdp_run)]
    assert steps == [SAVE, STEPS]
    d = fsdp_run / f"checkpoint_{SAVE:08d}"
    meta = json.loads((d / "meta.json").read_text())
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "checkpoint.pt"} == set(meta["files"])
    assert not list(fsdp_run.glob(".tmp-*"))                 # the staging dirs were renamed into place
    assert verify_checkpoint(d) == (d / "checkpoint.pt", SAVE)
    # a tool without a process group (evaluate, export, promote) gets the whole model in state["model"] ...
    from nsa.model import TinyLM
    state = load_checkpoint(d)
    assert state["sharded"]["world_size"] == 2 and len(state["data"]["ranks"]) == 2
    cfg = config_from_dict(state["config"])
    whole = TinyLM.from_config(cfg.model, cfg.nsa)
    whole.load_state_dict(state["model"], strict=True)
    # ... and the trainer's read (no whole model in memory) loads the same weights from the shards
    lean = load_checkpoint(d, full_model=False)
    assert lean["model"] == {}
    model = TinyLM.from_config(cfg.model, cfg.nsa)
    load_model_weights(model, lean)
    for (k, a), b in zip(whole.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    fresh = TinyLM.from_config(cfg.model, cfg.nsa).state_dict()
    assert not torch.equal(fresh["blocks.0.mlp.down.weight"], model.state_dict()["blocks.0.mlp.down.weight"])
    # a shard cut short makes the whole checkpoint incomplete: invisible to resume, left alone by prune
    runs = fsdp_run.parent / "copy"
    shutil.copytree(fsdp_run, runs / "r", ignore=shutil.ignore_patterns("heartbeat*"))
    with open(runs / "r" / f"checkpoint_{STEPS:08d}" / "__1_0.distcp", "r+b") as fh:
        fh.truncate(10)
    assert "__1_0.distcp has 10 of" in checkpoint_problem(runs / "r" / f"checkpoint_{STEPS:08d}")
    assert [s for s, _ in list_checkpoints(runs / "r")] == [SAVE]
    assert prune_checkpoints(runs / "r", keep=1) == [] and (runs / "r" / f"checkpoint_{STEPS:08d}").is_dir()
    # a staging dir left by a save cut short is removed by the next launch on the run
    from nsa.train.rundir import claim_run, commit_run, release_run
    (runs / "r" / f".tmp-checkpoint_{STEPS + 1:08d}-dcp").mkdir()
    claim = claim_run(runs, "r")
    try:
        assert claim.resume_step == SAVE
        notes = commit_run(claim.run_dir, "x: 1\n", keep=3)
    finally:
        release_run(claim.run_dir)
    assert any("sharded checkpoint save that was cut short" in n for n in notes), notes
    assert not list((runs / "r").glob(".tmp-*"))


@pytest.mark.parametrize("world", [1, 2])
def test_resume_continues_the_uninterrupted_losses(tiny_data, tmp_path, fsdp_run, world):
    """The 2-process run's checkpoint at step SAVE, resumed on 1 process (resharded to whole tensors, both
    ranks' data streams on one rank) or on 2 (a restart): the following steps' losses are the run's."""
    ref = _losses(fsdp_run, 2)
    cfg = _cfg(tiny_data, tmp_path, f"fsdp{world}", runtime__sharding="fsdp")
    run = _train(cfg, world, resume_from=fsdp_run / f"checkpoint_{SAVE:08d}")
    got = _losses(run, world)
    assert sorted(got) == list(range(SAVE + 1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), s
    start = next(r for r in read_heartbeat(run / "heartbeat_rank0.jsonl") if r["kind"] == "start")
    assert start["data_streams"] == 2 // world and start["resumed_from"].endswith(f"checkpoint_{SAVE:08d}")
    # its checkpoint keeps the 2-rank data split, so a 1-process run could go back to 2 processes
    final = load_checkpoint(run / f"checkpoint_{STEPS:08d}")
    assert len(final["data"]["ranks"]) == 2 and final["sharded"]["world_size"] == world


def test_ddp_checkpoint_continues_under_fsdp(tiny_data, tmp_path, ddp_run):
    """A whole checkpoint.pt (runtime.sharding=ddp) resumed with runtime.sharding=fsdp: weights and AdamW
    state split onto the shards, the following losses are the DDP run's."""
    ref = _losses(ddp_run, 2)
    run = _train(_cfg(tiny_data, tmp_path, "ddp-to-fsdp", runtime__sharding="fsdp"), 2,
                 resume_from=ddp_run / f"checkpoint_{SAVE:08d}")
    got = _losses(run, 2)
    assert sorted(got) == list(range(SAVE + 1, STEPS + 1))
    for s in got:
        assert got[s] == pytest.approx(ref[s], rel=1e-5), s
    assert load_checkpoint(run / f"checkpoint_{STEPS:08d}", full_model=False)["sharded"]["world_size"] == 2


def test_config_errors():
    with pytest.raises(ConfigError, match=r"runtime.sharding='zero' is not one of \['ddp', 'fsdp'\]"):
        resolve_config(None, ["runtime.sharding=zero"], env={})
    with pytest.raises(ConfigError, match="runtime.sharding=fsdp does not take runtime.precision=fp16.*bf16"):
        resolve_config(None, ["runtime.sharding=fsdp", "runtime.precision=fp16", "runtime.use_gpu=true"], env={})
    with pytest.raises(ConfigError, match="runtime.context_parallel=0 must be >= 1"):
        resolve_config(None, ["runtime.context_parallel=0"], env={})
    assert resolve_config(None, [], env={})[0].runtime.sharding == "ddp"


def test_cuda_graph_falls_back_to_eager_under_fsdp():
    from nsa.train.graphed import graph_unsupported
    from nsa.train.precision import setup_precision
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    why = graph_unsupported(model, opt, setup_precision("bf16", torch.device("cpu")), torch.device("cuda"),
                            sharding="fsdp")
    assert why and why.startswith("runtime.sharding=fsdp")


def test_1b_profile():
    cfg, _ = resolve_config(str(PIPELINES / "configs" / "fsdp_1b.yaml"), [], env={})
    assert cfg.runtime.sharding == "fsdp" and cfg.runtime.precision == "bf16"
    from nsa.model import TinyLM
    with torch.device("meta"):
        n = TinyLM.from_config(cfg.model, cfg.nsa).num_params()
    assert 0.9e9 < n < 1.3e9, n
