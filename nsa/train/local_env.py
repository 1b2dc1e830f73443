"""A single-process LoopEnv without Ray: the same loop on plain parquet iteration.

Used by fast tests of the loop's control logic and by bench/bench_train.py's baseline. Resume-by-name
needs nothing here (the loop resumes from the newest checkpoint in the run dir); ``report`` copies the
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
    rank = 0
    world_size = 1

    def __init__(self, cfg: RunConfig, run_dir: str | Path, device: str | torch.device = "cpu") -> None:
        from nsa.data.shards import check_data_path, resolve_val_files
        self.cfg, self.run_dir, self.device = cfg, Path(run_dir), torch.device(device)
        self._files = check_data_path(cfg.data.path)
        self._val_files = resolve_val_files(cfg.data.path)
        self.reports: list[dict[str, Any]] = []

    def prepare_model(self, model: nn.Module, ddp: bool = True) -> nn.Module:
        return model

    def _iter(self, files: list[str]) -> Iterator[torch.Tensor]:
        from nsa.data.ray_data import iter_packed_batches
        d = self.cfg.data
        for b in iter_packed_batches(files, self.cfg.train.seq_len, d.tokenizer, self.cfg.train.batch_size,
                                     tiktoken_path=d.tiktoken_path):
            yield torch.from_numpy(b).to(self.device)

    def train_batches(self, epoch: int) -> Iterator[torch.Tensor]:
        return self._iter(self._files)

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
