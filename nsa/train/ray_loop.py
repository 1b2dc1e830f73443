"""Ray Train glue: ``train_loop_per_worker(config)`` for ``TorchTrainer``. The only nsa module that imports
ray at import time; the loop itself (nsa/train/loop.py) knows nothing about Ray.

``config`` (built by nsa/launch/builder.py): {"cfg": RunConfig.to_dict(), "run_dir": abs path,
"mlflow_uri": str | None, "resume_from": abs path | None, "torch_threads": int}.

Per worker: rank/world/device from ``ray.train``; DDP via ``ray.train.torch.prepare_model`` (gloo on CPU,
NCCL on GPU, set up by TorchTrainer), or FSDP2 by the loop over the same group (runtime.sharding=fsdp), with
context parallelism's CP groups made by the loop from that group (runtime.context_parallel, nsa/train/cp.py);
parquet train data from this rank's own Ray Data stream over its row groups (``train_stream``, seekable on
resume: nsa/data/position.py; under CP the stream of its data-parallel replica), synthetic train data from
``get_dataset_shard("train").iter_torch_batches`` (one call per epoch); the val set is not split (every
rank evaluates the same first ``train.eval_batches`` batches, fetched once); resume from
``ray.train.get_checkpoint()``; checkpoints and eval metrics through ``ray.train.report`` (a barrier:
every rank calls it at the same steps, only rank 0 attaches a checkpoint).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import ray.train
import ray.train.torch
import torch
from torch import nn

from nsa.config import RunConfig, config_from_dict
from nsa.train.checkpoint import load_checkpoint, persist_checkpoint
from nsa.train.loop import run_training


class RayEnv:
    """LoopEnv backed by the Ray Train worker context."""

    def __init__(self, cfg: RunConfig, run_dir: Optional[Path] = None) -> None:
        self.run_dir = run_dir          # where Ray persists checkpoints (storage_path/name, see builder)
        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.device = ray.train.torch.get_device() if cfg.runtime.use_gpu else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._cfg = cfg
        self._batch_size = cfg.train.batch_size
        self._prefetch = cfg.data.prefetch_batches
        # parquet data: each rank streams its own read units (train_stream), so a resume can seek;
        # the driver's split train dataset serves the data that cannot seek (synthetic)
        self.seekable = cfg.data.source == "parquet"
        self._train = None if self.seekable else ray.train.get_dataset_shard("train")
        self._files: Optional[list[str]] = None
        self._rg_rows: Optional[list[list[int]]] = None
        try:
            self._val = ray.train.get_dataset_shard("val")
        except (KeyError, ValueError):
            self._val = None

    def prepare_model(self, model: nn.Module, ddp: bool = True) -> nn.Module:
        if self.world_size <= 1 or not ddp:
            return model.to(self.device)
        return ray.train.torch.prepare_model(model, move_to_device=self.device)

    def _iter(self, shard: Any) -> Iterator[torch.Tensor]:
        try:
            for b in shard.iter_torch_batches(batch_size=self._batch_size, prefetch_batches=self._prefetch,
                                              dtypes=torch.int64, device=self.device, drop_last=True,
                                              pin_memory=self.device.type == "cuda"):
                yield b["input_ids"]                                  # [b, T+1] int64
        except Exception:
            # Ray Data's error names neither the shard nor the row group: find them (one line)
            from nsa.data.shards import DataError, diagnose_data_error
            where = diagnose_data_error(self._cfg.data.path) if self._cfg.data.source == "parquet" else None
            if where:
                raise DataError(where) from None
            raise

    def train_batches(self, epoch: int) -> Iterator[torch.Tensor]:
        if self._train is None:
            return iter(self.train_stream(epoch, None))
        return self._iter(self._train)

    def train_stream(self, epoch: int, start: Any = None, rank: Optional[int] = None,
                     world: Optional[int] = None) -> Any:
        """This rank's batches of ``epoch`` from ``start`` (a DataPosition; None: the epoch's start), read
        by Ray Data tasks over this rank's row groups (nsa/data/position.py); None for synthetic data.
        ``rank``/``world``: another data rank's stream (a resume on fewer ranks, nsa/train/data_ranks.py)."""
        if not self.seekable:
            return None
        from nsa.data.passkey import with_passkey
        from nsa.data.position import DeviceEpoch, rank_epoch, row_group_rows
        from nsa.data.ray_data import _resolve_tokenizer, iter_ray_units
        from nsa.data.shards import check_data_path
        d, t = self._cfg.data, self._cfg.train
        if self._files is None:
            self._files = check_data_path(d.path)               # verified once per data dir (cached)
            self._rg_rows = row_group_rows(self._files)
        tok = _resolve_tokenizer(d.tokenizer, d.tiktoken_path)
        files = self._files
        rank, world = self.rank if rank is None else rank, self.world_size if world is None else world
        ep = rank_epoch(files, self._rg_rows, epoch=epoch, rank=rank, world=world,
                        seq_len=t.seq_len, batch_size=t.batch_size, shuffle_seed=d.shuffle_seed, start=start,
                        source=lambda units: self._diagnosed(iter_ray_units(files, units, tok,
                                                                            prefetch_batches=self._prefetch)))
        return DeviceEpoch(with_passkey(ep, self._cfg, tok, rank), self.device)

    def _diagnosed(self, it: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from it
        except Exception:
            from nsa.data.shards import DataError, diagnose_data_error
            where = diagnose_data_error(self._cfg.data.path)
            if where:
                raise DataError(where) from None
            raise

    def val_batches(self, n: int) -> list[torch.Tensor]:
        if self._val is None or n <= 0:
            return []
        out = []
        for b in self._iter(self._val):
            out.append(b)
            if len(out) >= n:
                break
        return out

    def resume_state(self) -> Optional[dict[str, Any]]:
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            return None
        with ckpt.as_directory() as d:
            return load_checkpoint(d, full_model=False)   # a sharded one: each rank reads its shards

    def _persist(self, checkpoint: "ray.train.Checkpoint", dir_name: str) -> "ray.train.Checkpoint":
        """Ray's checkpoint_upload_fn: the same directory Ray's own upload would write (storage_path/name
        is the run dir, see the builder), but complete or absent (nsa.train.checkpoint.persist_checkpoint)
        instead of copied file by file into its final name."""
        assert self.run_dir is not None
        target = persist_checkpoint(checkpoint.path, self.run_dir / dir_name)
        return ray.train.Checkpoint.from_directory(str(target))

    def report(self, metrics: dict[str, Any], ckpt_dir: Optional[Path], dir_name: Optional[str]) -> None:
        ckpt = ray.train.Checkpoint.from_directory(str(ckpt_dir)) if ckpt_dir is not None else None
        upload = self._persist if (ckpt is not None and self.run_dir is not None and dir_name) else None
        ray.train.report(metrics, checkpoint=ckpt, checkpoint_dir_name=dir_name, checkpoint_upload_fn=upload)


def _worker_logging() -> None:
    """WARNING and above from this worker reach the console (a locally started instance runs Ray's
    actors at ERROR, see nsa/launch/builder.start_local_ray); Ray Train's INFO line per report
    ("Reporting training result ...") stays off: our progress lines and heartbeats say the same."""
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    for h in root.handlers:
        if h.level > logging.WARNING:
            h.setLevel(logging.WARNING)
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    try:  # that one logger is named after its file path, not its module (ray 2.60): reach it directly
        from ray.train.v2._internal.execution import context as _ctx
        _ctx.logger.setLevel(logging.WARNING)
    except (ImportError, AttributeError):
        pass


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Entry point run by every Ray Train worker."""
    torch.set_num_threads(int(config.get("torch_threads", 1)))
    _worker_logging()
    cfg = config_from_dict(config["cfg"])
    from nsa.telemetry import Heartbeat
    from nsa.telemetry.heartbeat import KIND_ATTEMPT
    from nsa.train.failures import not_retried
    # one record per attempt, written before anything can fail (data, model, resume): counts Ray's retries
    with Heartbeat(config["run_dir"], ray.train.get_context().get_world_rank()) as hb:
        hb.write(KIND_ATTEMPT, 0)
    with not_retried():     # a user error (storage, data) leaves as NotRetried: Ray Train does not retry it
        env = RayEnv(cfg, Path(config["run_dir"]))
        run_training(cfg, Path(config["run_dir"]), env, mlflow_uri=config.get("mlflow_uri"),
                     resume_from=config.get("resume_from"))
