"""A single-process LoopEnv without Ray: the same loop, reading the parquet row groups in process (the
same per-rank stream and seek as under Ray, nsa/data/position.py).

Used by fast tests of the loop's control logic and by bench/bench_train.py's baseline; with ``rank`` and
``world_size`` (a torch.distributed group the caller set up) it is one rank of a multi-process run
without Ray (DDP, or FSDP through the loop, tests/test_fsdp.py; context parallelism, tests/test_cp_train.py).
Resume-by-name needs nothing here (the loop resumes from the newest checkpoint in the run dir); ``report`` copies the
checkpoint into ``run_dir/<dir_name>`` atomically (a hidden temp dir renamed into place), never over an
existing complete one; an incomplete one left by a crash is set aside first.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn

from nsa.config import RunConfig
from nsa.train.checkpoint import persist_checkpoint

class LocalEnv:
    def __init__(self, cfg: RunConfig, run_dir: str | Path, device: str | torch.device = "cpu", rank: int = 0,
                 world_size: int = 1) -> None:
        from nsa.data.shards import check_data_path, resolve_val_files
        self.rank, self.world_size = rank, world_size
        self.cfg, self.run_dir, self.device = cfg, Path(run_dir), torch.device(device)
        self._files = check_data_path(cfg.data.path)
        self._val_files = resolve_val_files(cfg.data.path)
        self.reports: list[dict[str, Any]] = []
        self._rg_rows: Optional[list[list[int]]] = None

    def prepare_model(self, model: nn.Module, ddp: bool = True) -> nn.Module:
        model = model.to(self.device)
        if self.world_size <= 1 or not ddp:
            return model
        return nn.parallel.DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda"
                                                   else None)

    def _iter(self, files: list[str]) -> Iterator[torch.Tensor]:
        from nsa.data.ray_data import iter_packed_batches
        d = self.cfg.data
        for b in iter_packed_batches(files, self.cfg.train.seq_len, d.tokenizer, self.cfg.train.batch_size,
                                     tiktoken_path=d.tiktoken_path):
            yield torch.from_numpy(b).to(self.device)

    def train_batches(self, epoch: int) -> Iterator[torch.Tensor]:
        return iter(self.train_stream(epoch))

    seekable = True    # train_stream continues from a recorded DataPosition (nsa/data/position.py)

    def train_stream(self, epoch: int, start: Any = None, rank: Optional[int] = None,
                     world: Optional[int] = None) -> Any:
        """This epoch's batches read in process by row group, from ``start`` (None: the epoch's start), as
        data rank ``rank`` of ``world`` (default: this rank; nsa/train/data_ranks.py reads others too)."""
        from nsa.data.passkey import with_passkey
        from nsa.data.position import DeviceEpoch, iter_local_units, rank_epoch, row_group_rows
        from nsa.data.ray_data import _resolve_tokenizer
        d, t = self.cfg.data, self.cfg.train
        if self._rg_rows is None:
            self._rg_rows = row_group_rows(self._files)
        tok = _resolve_tokenizer(d.tokenizer, d.tiktoken_path)
        rank, world = self.rank if rank is None else rank, self.world_size if world is None else world
        ep = rank_epoch(self._files, self._rg_rows, epoch=epoch, rank=rank, world=world, seq_len=t.seq_len,
                        batch_size=t.batch_size, shuffle_seed=d.shuffle_seed, start=start,
                        source=lambda units: iter_local_units(self._files, units, tok))
        return DeviceEpoch(with_passkey(ep, self.cfg, tok, rank), self.device)

    def val_batches(self, n: int) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        if self._val_files:
            for b in self._iter(self._val_files):
                out.append(b)
                if len(out) >= n:
                    break
        return out

    def resume_state(self) -> Optional[dict[str, Any]]:
        return None      # the loop itself picks the newest loadable checkpoint of the run dir

    def report(self, metrics: dict[str, Any], ckpt_dir: Optional[Path], dir_name: Optional[str]) -> None:
        self.reports.append(dict(metrics))
        if ckpt_dir is not None:
            persist_checkpoint(ckpt_dir, self.run_dir / (dir_name or f"checkpoint_{len(self.reports):08d}"))
