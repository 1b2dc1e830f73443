"""FSDP2 for the training loop (``runtime.sharding=fsdp``): sharding, and sharded checkpoints through DCP.

Sharding: every transformer block, then the root (embedding, final norm, LM head), is wrapped with
``torch.distributed.fsdp.fully_shard`` over one flat mesh of all ranks, so parameters, gradients and AdamW
state are split across ranks and a block's full weights exist only while it runs. Mixed precision is
fully_shard's ``MixedPrecisionPolicy``: parameters all-gathered in runtime.precision's dtype, gradients
reduced in fp32 (the master weights stay fp32, as under DDP). One rank has nothing to shard: the model
stays bare and only the checkpoint layout is the sharded one.

Checkpoint layout (the same ``checkpoint_<step>`` directory contract as nsa/train/checkpoint.py):

    checkpoint.pt   what checkpoint.pt always holds, but "model" and "optimizer" empty and
                    "sharded": {"world_size", "files"} (weights_only, rank 0 writes it)
    .metadata, __<rank>_0.distcp   ``torch.distributed.checkpoint`` of {"model", "optimizer"} by
                    fully-qualified name (every rank writes its own shard)
    meta.json       lists every file above with its size (written last): complete or invisible

Every rank writes into one hidden ``.tmp-checkpoint_<step>-dcp`` directory of the run dir (the run dir
must be storage every worker writes, as Ray's checkpoints already need), which ``persist_checkpoint``
then renames into place. DCP reshards on load, so a checkpoint saved by N ranks resumes on M; a whole
checkpoint of a runtime.sharding=ddp run continues under fsdp (``load_whole``), and tools read a sharded one
whole (``full_model_state``, through checkpoint.load_checkpoint).
"""
from __future__ import annotations

import contextlib
import shutil
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

DCP_KEYS = ("model", "optimizer")


def _dist_world() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def mixed_precision(dtype: Optional[torch.dtype]) -> Any:
    """fully_shard's policy for autocast dtype ``dtype`` (None: fp32 throughout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is not None else None)


def shard_model(model: nn.Module, device: torch.device, dtype: Optional[torch.dtype]) -> nn.Module:
    """Wrap each block of ``model.blocks`` and then the root with fully_shard over all ranks (in place;
    the module keeps its parameter names). Every rank must hold the same initial weights (same seed)."""
    world = _dist_world()
    if world <= 1:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    mp = mixed_precision(dtype)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@contextlib.contextmanager
def _dcp(no_dist: bool):
    """DCP in one process without a process group (a resume on 1 rank, a tool) warns on every call that it
    assumes so: that is the intent here."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


STAGING_GLOB = ".tmp-checkpoint_*-dcp"


def staging_dir(run_dir: Path, name: str) -> Path:
    """The hidden directory all ranks write a sharded checkpoint into (out of the checkpoint_* namespace;
    a save cut short leaves it behind, and the next launch's commit_run removes it)."""
    return Path(run_dir) / f".tmp-{name}-dcp"


def write_shards(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                 barrier: Any) -> Optional[list[str]]:
    """Every rank: write its shard of model + optimizer into ``directory`` (emptied first). Returns, on
    rank 0 once every rank's shard is on disk, the files written (None elsewhere): rank 0 then adds
    checkpoint.pt and meta.json (``sharded_state``, checkpoint.save_checkpoint). ``barrier()`` syncs the
    ranks (the loop's CPU group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    directory = Path(directory)
    if rank == 0:                            # a crashed save's leftovers are never mixed into this one
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    barrier()
    msd, osd = get_state_dict(model, optimizer)
    no_dist = _dist_world() <= 1
    with _dcp(no_dist):
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(directory), no_dist=no_dist)
    barrier()                                # every shard is on disk before rank 0 lists them
    if rank != 0:
        return None
    files = sorted(f.name for f in directory.iterdir() if f.is_file())
    missing = sorted({f"__{r}_0.distcp" for r in range(_dist_world())} - set(files))
    if missing:
        raise OSError(f"sharded checkpoint {directory} lacks {missing}: runtime.sharding=fsdp needs the run dir on "
                      "storage every worker writes (set runtime.storage_root to the shared mount)")
    return files


def sharded_state(state: dict[str, Any], files: list[str]) -> dict[str, Any]:
    """build_state's dict as a sharded checkpoint's checkpoint.pt: model and optimizer live in ``files``."""
    return {**state, "model": {}, "optimizer": {}, "sharded": {"world_size": _dist_world(), "files": files}}


def full_model_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a sharded checkpoint, in one process without a template model
    (evaluation, export, promotion read checkpoint.pt's "model" as they always have)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = dcp.FileSystemReader(str(directory)).read_metadata()
    out = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
           for k, m in meta.state_dict_metadata.items()
           if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with _dcp(True):
        dcp.load({"model": out}, checkpoint_id=str(directory), no_dist=True)
    return out


def load_sharded(state: dict[str, Any], model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """Load a sharded checkpoint's model (and optimizer) into ``model`` (sharded or bare, any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
    where = state["sharded"].get("dir")
    if where is None:
        raise ValueError("a sharded checkpoint's state was not read by load_checkpoint (it has no directory)")
    no_dist = _dist_world() <= 1
    if optimizer is None:
        sd = {"model": model.state_dict()}
        with _dcp(no_dist):
            dcp.load(sd, checkpoint_id=where, no_dist=no_dist)
        set_model_state_dict(model, sd["model"])
        return
    msd, osd = get_state_dict(model, optimizer)
    sd = {"model": msd, "optimizer": osd}
    with _dcp(no_dist):
        dcp.load(sd, checkpoint_id=where, no_dist=no_dist)
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])


def load_whole(state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A checkpoint of whole tensors (runtime.sharding=ddp) into a sharded model: every rank holds the
    whole state and keeps its shards. AdamW's state is keyed by position in its param groups there; the
    groups are built the same way here (schedule.build_optimizer), so position i names the same parameter."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    osd = state["optimizer"]
    optim = {"state": {order[i]: v for i, v in osd["state"].items()},
             "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim,
                   options=StateDictOptions(full_state_dict=True))
