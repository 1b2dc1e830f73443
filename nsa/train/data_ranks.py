"""Resuming on fewer ranks than a checkpoint was written by, with the same batches and losses.

A run's data is split into D streams at its start (D = its world size; rank r reads stream r, see
nsa/data/position.py), and a checkpoint records each stream's DataPosition. A resume on W ranks where W
divides D gives rank r the k = D / W streams r*k .. r*k+k-1 and takes ``train.accumulate`` micro-batches
from each per step: k x accumulate micro-batches, the same global batch of the same sequences as the D
ranks took (the step's gradient is their mean either way), so the following losses are the uninterrupted
run's. Its checkpoints again record D positions, so it can go back to D ranks. Any other change of world
size falls back to fast-forwarding (checkpoint.rank_positions' note). Under runtime.context_parallel=N the
streams are the data-parallel replicas' (D = world / N; every rank of a CP group reads its replica's stream
through StreamEnv, nsa/train/cp.py), so the same rules hold with replicas in place of ranks.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from nsa.train.batches import BatchStream
from nsa.train.checkpoint import rank_positions


def rank_streams(data: dict[str, Any], world: int) -> tuple[Optional[list[list[Any]]], Optional[str]]:
    """(per rank, the DataPositions of the streams it continues; note) or (None, why it fast-forwards)."""
    ranks = data.get("ranks")
    if ranks is None or len(ranks) % world:
        return None, rank_positions(data, world)[1]
    positions, _ = rank_positions(data, len(ranks))
    k = len(ranks) // world
    note = None if k == 1 else (
        f"resume: the checkpoint's data position is for {len(ranks)} ranks, this run has {world}: each rank "
        f"continues {k} of those streams ({k} x train.accumulate micro-batches per step, the same global batch)")
    return [positions[r * k:(r + 1) * k] for r in range(world)], note


class StreamEnv:
    """``env`` seen as rank ``stream`` of a ``streams``-rank world, for the data only (a resume on fewer ranks;
    the replica's stream under context parallelism)."""

    seekable = True

    def __init__(self, env: Any, stream: int, streams: int) -> None:
        self.env, self.stream, self.streams = env, stream, streams

    def train_stream(self, epoch: int, start: Any = None) -> Any:
        return self.env.train_stream(epoch, start, rank=self.stream, world=self.streams)

    def train_batches(self, epoch: int) -> Any:
        return iter(self.train_stream(epoch))


class MultiStream:
    """BatchStream's interface over k data streams: ``next(n)`` takes n micro-batches from each in turn."""

    def __init__(self, env: Any, rank: int, seeks: list[Any], streams: int) -> None:
        k = len(seeks)
        self.parts = [BatchStream(StreamEnv(env, rank * k + j, streams), seek.epoch, 0, seek=seek)
                      for j, seek in enumerate(seeks)]
        self.samples = 0

    @property
    def epoch(self) -> int:
        return self.parts[0].epoch

    def next(self, n: int) -> tuple[list[torch.Tensor], float]:
        out, wait = [], 0.0
        for p in self.parts:
            got, s = p.next(n)
            out += got
            wait += s
        self.samples += sum(b.shape[0] for b in out)
        return out, wait

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def position(self, world_size: int) -> dict[str, int]:
        return {**self.parts[0].position(world_size), "samples_seen": self.samples * world_size}

    def rank_position(self) -> Any:
        """One DataPosition per stream (the loop flattens the ranks' lists in rank order)."""
        got = [p.rank_position() for p in self.parts]
        return None if any(g is None for g in got) else got
