"""runtime.context_parallel=N in the training loop: one sequence split across N ranks (nsa/dist/context_parallel.py),
composed with data parallelism over world = dp * N ranks.

Ranks: CP groups are N consecutive ranks (rank r is CP rank r % N of data-parallel replica r // N), so a CP
group sits on one host when N divides the GPUs per host. Every rank of a CP group trains on the same
sequences: with seekable data (parquet) each rank reads the stream of its DP rank (r // N of dp streams,
nsa/train/data_ranks.py's StreamEnv), and checkpoints record those dp positions (one per CP group, taken from
its first rank); data that cannot seek (synthetic, split by Ray across all ranks) is read by every rank and
the CP group's first rank broadcasts its batch.

Loss and gradients: each rank shards inputs and labels with shard_sequence (labels padded with -100) and
runs the model inside context_parallel(...), entered once for the trainer's life (block checkpointing
recomputes forwards in backward, which must see the same CP layers). Its loss is its share of the
replica's token mean: CE summed over its real tokens / (B * T), so the shares of a CP group add up to the
single-process loss. DDP (or FSDP) runs over all dp * N ranks and averages gradients over them; the
backward loss is the share times N, so that average is (1/dp) * sum over replicas of (sum over the
CP group of shares' gradients) = the mean over replicas of the single-process gradient, the same as
data parallelism without CP (one all-reduce, no second collective over the CP group). The logged loss is
the replica's: the shares all-reduced (sum) over the CP group on the device, one 0-d collective per step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nsa.dist import check_cp_length, context_parallel, local_positions, shard_sequence
from nsa.train.data_ranks import StreamEnv
from nsa.train.failures import NotRetried


def cp_groups(world: int, size: int) -> list[list[int]]:
    """The CP groups of a world: [[0..N-1], [N..2N-1], ...] (consecutive ranks, one per DP replica). A world
    that N does not divide (num_workers=-1 on an odd GPU count) is a user error Ray must not retry."""
    if size < 1 or world % size:
        raise NotRetried(f"runtime.context_parallel={size} must divide the world size {world} (runtime.num_workers, "
                         f"or the GPUs with num_workers=-1): use a multiple of {size} workers")
    return [list(range(d * size, (d + 1) * size)) for d in range(world // size)]


class ContextParallel:
    """This rank's place in the dp x cp grid and what the loop does differently under CP (size 1: nothing;
    every method is then the plain data-parallel behaviour)."""

    def __init__(self, size: int, rank: int, world: int, seq_len: int, device: torch.device) -> None:
        groups = cp_groups(world, size)
        self.size, self.rank, self.world, self.seq_len = size, rank, world, seq_len
        self.dp, self.dp_rank, self.cp_rank = world // size, rank // size, rank % size
        self.leader = self.dp_rank * size               # global rank of this CP group's first rank
        self.group: Any = None
        self._ctx = contextlib.ExitStack()
        self.positions: Optional[torch.Tensor] = None   # absolute positions of this rank's rows [2c]
        if size == 1:
            return
        check_cp_length(seq_len, size)
        # every rank creates every group, in the same order (new_group is collective over the world); a group
        # of its own even when N = world, so the CP collectives never share a communicator with DDP's buckets
        for ranks in groups:
            g = dist.new_group(ranks)
            if rank in ranks:
                self.group = g
        self.positions = local_positions(seq_len, self.cp_rank, size, device)

    @property
    def active(self) -> bool:
        return self.size > 1

    def enter(self, model: nn.Module) -> None:
        """Run every NSA layer of `model` (the bare module, before DDP) on its shard until close()."""
        if self.active:
            self._ctx.enter_context(context_parallel(model, seq_len=self.seq_len, group=self.group))

    def close(self) -> None:
        self._ctx.close()

    def graph_reason(self) -> Optional[str]:
        """Why the CUDA-graph step does not apply (None: it may)."""
        if self.active:
            return (f"runtime.context_parallel={self.size}: the CP collectives and the data-dependent chunk "
                    "calls are not captured yet")
        return None

    # ------------------------------------------------------------------ loss
    def lm_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, prec: Any, ignore: int) -> torch.Tensor:
        """This rank's share of the mean CE over the scored targets of x, y [B, T] (nsa/train/step.py's split of the
        full rows, the same on every rank of the CP group; ``ignore`` marks skipped targets and pads the shard): CE
        summed over its shard / the rows' scored count (on the device, no sync); the group's shares sum to the loss."""
        x_l = shard_sequence(x, self.cp_rank, self.size)                        # [B, 2c]
        y_l = shard_sequence(y, self.cp_rank, self.size, pad_value=ignore)      # [B, 2c]
        with prec.autocast():
            logits = model(x_l)                                                 # [B, 2c, V]
        ce = F.cross_entropy(logits.float().flatten(0, 1), y_l.flatten(), ignore_index=ignore, reduction="sum")
        return ce / (y != ignore).sum()

    def sum_shares(self, loss: torch.Tensor) -> torch.Tensor:
        """The shares (0-d, on the device) summed over the CP group in place: the replica's loss."""
        if self.active:
            dist.all_reduce(loss, group=self.group)
        return loss

    # ------------------------------------------------------------------ data
    def data_env(self, env: Any) -> Any:
        """What the loop reads batches from: env itself, or under CP with seekable data this rank's DP stream."""
        if self.active and getattr(env, "seekable", False):
            return StreamEnv(env, self.dp_rank, self.dp)
        return env

    def wrap_stream(self, stream: Any, env: Any) -> Any:
        """Data that cannot seek is read by every rank (Ray splits it over all of them): the CP group's first
        rank's batches win."""
        if self.active and not getattr(env, "seekable", False):
            return _Broadcast(stream, self.group, self.leader)
        return stream

    def streams(self, positions: list[Any]) -> list[Any]:
        """All ranks' DataPositions (world of them, rank order) -> the dp streams' (one per CP group)."""
        return positions[::self.size]


class _Broadcast:
    """A BatchStream whose batches are replaced by the CP group's first rank's (every rank still reads its
    own, so the Ray split advances alike and the recorded batch counts agree)."""

    def __init__(self, inner: Any, group: Any, src: int) -> None:
        self.inner, self.group, self.src = inner, group, src

    def next(self, n: int) -> tuple[list[torch.Tensor], float]:
        got, wait = self.inner.next(n)
        got = [b.contiguous() for b in got]
        for b in got:       # [b, T+1] int64 on the device, the same shape on every rank (drop_last)
            dist.broadcast(b, self.src, group=self.group)
        return got, wait

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
