"""The loop's micro-batch stream: epochs, the data position, and resuming at it (seek or fast-forward)."""
from __future__ import annotations

import time
from typing import Any, Iterator

import torch

from nsa.data.position import SeekError


class BatchStream:
    """Micro-batches from the env, looping over epochs, with a resumable position.

    Seeking envs (``env.train_stream(epoch, start)`` returns an iterable with ``position()``, see
    nsa/data/position.py) continue from this rank's recorded position: nothing consumed is read again.
    Otherwise (synthetic data, a checkpoint without positions) ``env.train_batches`` is fast-forwarded
    by ``skip`` batches."""

    def __init__(self, env: Any, epoch: int = 0, skip: int = 0, seek: Any = None) -> None:
        self.env, self.epoch, self.batches_in_epoch, self._skip = env, epoch, 0, skip
        self._seek = seek                   # this rank's DataPosition, used for the first epoch only
        if seek is not None:
            self.batches_in_epoch = seek.batches_in_epoch
        self._cur: Any = None               # the seeking epoch being read (None: not seeking)
        self.samples = 0
        self._it = self._gen()

    def _epoch_source(self) -> Any:
        start, self._seek = self._seek, None
        stream = getattr(self.env, "train_stream", None)
        try:
            src = stream(self.epoch, start) if stream is not None else None
        except SeekError as e:      # the data changed under the checkpoint: re-read up to its batch count
            print(f"resume: cannot seek ({e}): fast-forwarding {start.batches_in_epoch} batches", flush=True)
            src, self._skip, self.batches_in_epoch = stream(self.epoch, None), start.batches_in_epoch, 0
            start = None
        if src is not None and start is not None:
            self.batches_in_epoch, self._skip = start.batches_in_epoch, 0
        self._cur = src
        return src if src is not None else self.env.train_batches(self.epoch)

    def _gen(self) -> Iterator[torch.Tensor]:
        while True:
            produced, fresh = 0, self.batches_in_epoch == 0 and self._skip == 0 and self._seek is None
            for b in self._epoch_source():
                produced += 1
                self.batches_in_epoch += 1
                if self._skip > 0:      # resume without a position: fast-forward by re-reading
                    self._skip -= 1
                    continue
                yield b
            if produced == 0 and fresh:
                from nsa.data.shards import DataError   # a user error: Ray Train does not retry it
                raise DataError(f"the training data produced no batch in epoch {self.epoch}: fewer rows per "
                                 "worker than train.batch_size; lower train.batch_size/seq_len or add data")
            self.epoch += 1
            self.batches_in_epoch = 0

    def next(self, n: int) -> tuple[list[torch.Tensor], float]:
        """``n`` micro-batches and the seconds spent waiting for them."""
        t0 = time.perf_counter()
        out = [next(self._it) for _ in range(n)]
        self.samples += sum(b.shape[0] for b in out)
        return out, time.perf_counter() - t0

    def close(self) -> None:
        """End the epoch being read (a Ray Data stream shuts its executor down now, not at exit)."""
        self._it.close()

    def position(self, world_size: int) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch,
                "samples_seen": self.samples * world_size}

    def rank_position(self) -> Any:
        """This rank's DataPosition after the last batch taken (None when the data cannot seek). Before
        the first batch of a run: the start (or the recorded position) of the current epoch."""
        if self._cur is not None:
            return self._cur.position()
        if self._seek is not None:
            return self._seek
        if getattr(self.env, "train_stream", None) is None:
            return None
        from nsa.data.position import DataPosition
        return DataPosition(epoch=self.epoch) if self.batches_in_epoch == 0 and self._skip == 0 else None
