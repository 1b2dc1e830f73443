"""Context parallelism (CP) for the NSA op and layer: one sequence split across the N ranks of a group.

Sharding (load-balanced for causality): positions [0, T) are cut into 2N equal chunks of
c = ceil(T / 2N) positions; rank r holds chunk r and chunk 2N-1-r, so every rank has one early
(cheap) and one late (expensive) chunk of causal attention. A rank's local tensors are [B, 2c, ...]
= [chunk r | chunk 2N-1-r] (shard_sequence). When 2N does not divide T the last chunk(s) are padded
past T: padded positions are never read as keys, their outputs are exactly zero and get no gradient.
Every rank must hold at least one real position ((N-1)*c < T, i.e. T >= N: check_cp_length), since
each rank's backward has to reach the collective.

Communication (the simplest correct version): the raw per-branch keys/values (and in the layer the
raw k_cmp/v_cmp the compression reads) are all-gathered once per call into the full [B, T, ...]
sequence; each rank then runs the op for its own queries at their absolute positions (the op's
query-offset path: the Triton kernels' offset route (nsa/ops/route.py offset_route) on the triton backend,
nsa_torch / nsa_reference with pos0 otherwise; the same arithmetic as prefill). Backward
sends each rank's K/V gradient rows to their owner (all_to_all) and the owner sums the N
contributions in rank order 0..N-1, so the result does not depend on the backend's reduction order.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from nsa.layers.attention import NSAAttention
from nsa.layers.dense import DenseAttention
from nsa.ops.batched import nsa_torch
from nsa.ops.common import NSAParams, num_cmp_tokens, safe_scale, validate_inputs
from nsa.ops.dispatch import KernelPolicy, _check_requested, cached_policy
from nsa.ops.fallbacks import count_fallback
from nsa.ops.reference import nsa_reference
from nsa.ops.tuning import KernelTuning

__all__ = ["chunk_len", "check_cp_length", "chunk_starts", "local_positions", "shard_sequence",
           "unshard_sequence", "gather_outputs", "gather_sequence", "cp_nsa_attention", "cp_nsa_layer",
           "context_parallel"]


# ------------------------------------------------------------------------------------ sharding rule
def chunk_len(seq_len: int, world: int) -> int:
    """c = ceil(seq_len / (2 * world)): positions per chunk; a rank holds 2c (padding included)."""
    return -(-seq_len // (2 * world))


def check_cp_length(seq_len: int, world: int) -> None:
    """Raise ValueError (naming the field) unless every one of `world` ranks holds a real position."""
    for name, val in (("seq_len", seq_len), ("context_parallel", world)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name} must be a positive int, got {val!r}")
    c = chunk_len(seq_len, world)
    if (world - 1) * c >= seq_len:
        raise ValueError(f"seq_len={seq_len} is too short for context_parallel={world}: rank {world - 1} "
                         f"would hold only padding (chunks of {c}); use seq_len >= {world} or fewer "
                         "ranks")


def chunk_starts(seq_len: int, rank: int, world: int) -> tuple[int, int]:
    """Absolute first positions of rank's two chunks: (rank * c, (2*world - 1 - rank) * c)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    c = chunk_len(seq_len, world)
    return rank * c, (2 * world - 1 - rank) * c


def local_positions(seq_len: int, rank: int, world: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """Absolute positions of rank's local rows: int64 [2c] (rows past seq_len are padding)."""
    c = chunk_len(seq_len, world)
    a, b = chunk_starts(seq_len, rank, world)
    ar = torch.arange(c, device=device)
    return torch.cat((ar + a, ar + b))


def shard_sequence(x: torch.Tensor, rank: int, world: int, *, dim: int = 1,
                   pad_value: float | int = 0) -> torch.Tensor:
    """This rank's share of a full sequence: x [.., T, ..] (sequence at `dim`) -> [.., 2c, ..] =
    [chunk rank | chunk 2*world-1-rank], padded with pad_value past T (e.g. -100 for labels)."""
    T = x.shape[dim]
    check_cp_length(T, world)
    c = chunk_len(T, world)
    a, b = chunk_starts(T, rank, world)
    pad = 2 * world * c - T
    if pad:
        shape = list(x.shape)
        shape[dim] = pad
        x = torch.cat((x, x.new_full(shape, pad_value)), dim)
    return torch.cat((x.narrow(dim, a, c), x.narrow(dim, b, c)), dim)


def unshard_sequence(parts: torch.Tensor, seq_len: int, *, dim: int = 1) -> torch.Tensor:
    """Inverse of shard_sequence over all ranks: parts [world, .., 2c, ..] (rank-major, the local
    sequence at dim + 1 of parts) -> [.., seq_len, ..] in sequence order, padding dropped."""
    world, dim = parts.shape[0], dim % (parts.dim() - 1)
    c = chunk_len(seq_len, world)
    x = parts.movedim(dim + 1, 1)                               # [world, 2c, ...]
    x = x.reshape(world, 2, c, *x.shape[2:])
    # chunks 0..N-1 are the ranks' heads; chunk 2N-1-r is rank r's tail, so the tails in reverse
    full = torch.cat((x[:, 0], x[:, 1].flip(0)), 0).flatten(0, 1)   # [2N*c, ...]
    return full[:seq_len].movedim(0, dim)


def _group_info(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """x [...] from every rank -> [world, ...] (rank-major)."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))    # the collective's layout: ranks along dim 0
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor   # the newer name first
    gather(out, x.contiguous(), group=group)
    return out.view(world, *x.shape)


@torch.no_grad()
def gather_outputs(y_local: torch.Tensor, seq_len: int, group=None, *, dim: int = 1) -> torch.Tensor:
    """All ranks' local rows [.., 2c, ..] -> the full sequence [.., seq_len, ..] on every rank.
    Not differentiable (evaluation, logging, tests); training keeps losses local."""
    return unshard_sequence(_all_gather(y_local, group), seq_len, dim=dim)


# --------------------------------------------------------------------- autograd-aware collective
class _GatherSequence(torch.autograd.Function):
    """[B, 2c, F] local -> [B, 2N*c, F] full (sequence order) on every rank; backward returns each
    rank's gradient rows to their owner and sums them there in rank order (deterministic)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = _all_gather(x, group)
        return unshard_sequence(out, out.shape[0] * x.shape[1]).contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        B, L, F = grad.shape
        c = L // (2 * world)
        g = grad.reshape(B, 2 * world, c, F).transpose(0, 1)             # [2N, B, c, F] by chunk
        send = torch.stack((g[:world], g[world:].flip(0)), 2)           # [N, B, 2, c, F]: rank j's rows
        recv = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(recv, send.contiguous(), group=ctx.group)
        acc = recv[0]
        for i in range(1, world):   # a loop over ranks: rank order fixes the summation order
            acc = acc + recv[i]
        return acc.reshape(B, 2 * c, F), None


def gather_sequence(xs: list[torch.Tensor], seq_len: int, group=None) -> list[torch.Tensor]:
    """Local [B, 2c, H, D_i] tensors (one dtype) -> full [B, seq_len, H, D_i] each, in one collective;
    differentiable (the gradient of each full tensor goes back to the rows' owners)."""
    B, L = xs[0].shape[:2]
    flat = torch.cat([x.reshape(B, L, -1) for x in xs], -1)            # [B, 2c, sum H*D_i]
    full = _GatherSequence.apply(flat, group)[:, :seq_len]
    sizes = [x.shape[2] * x.shape[3] for x in xs]
    return [f.view(B, seq_len, x.shape[2], x.shape[3]) for f, x in zip(full.split(sizes, -1), xs)]


# ------------------------------------------------------------------------------------------- op
def _resolve(backend, q: torch.Tensor, v: torch.Tensor, gates: torch.Tensor) -> tuple[str, KernelTuning]:
    """("reference" | "torch" | "triton", the policy's tuning), as nsa_attention resolves them. A triton choice
    runs the Triton kernels with the query offset; a dtype or head size they do not take runs the torch path
    (counted as "cp:triton->torch")."""
    if not isinstance(backend, KernelPolicy):
        _check_requested(backend)
        backend = cached_policy(backend, q.device, q.dtype)
    used = backend.backend
    if used == "triton":
        from nsa.ops.triton import check_supported
        try:
            check_supported(q, v, gates)
        except NotImplementedError:
            count_fallback("cp:triton->torch")
            used = "torch"
    return used, backend.tuning


def _local_attention(q: torch.Tensor, gates: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                     kv: list[torch.Tensor], *, seq_len: int, rank: int, world: int, p: NSAParams,
                     scale: float | None, backend, tile: int | None, recompute: bool | None,
                     validate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries (q [B,2c,HQ,dk], gates [B,2c,HQ,3]) against the full K/V: kv =
    [k_slc, v_slc, k_win, v_win] each [B, T, H, *], k_cmp/v_cmp [B, N(T), H, *]. One op call per
    chunk at its absolute offset. Returns (o [B,2c,HQ,dv], block_idx [B,2c,H,n_sel]; padded rows 0/-1)."""
    k_slc, v_slc, k_win, v_win = kv
    B, _, HQ, dk = q.shape
    H, dv = k_slc.shape[2], v_slc.shape[3]
    c = chunk_len(seq_len, world)
    sc = safe_scale(scale, dk)
    used, tuning = _resolve(backend, q, v_slc, gates)
    # Traffic to cut later (the refined plan): the window of a chunk starting at s reads only
    # keys [s-w+1, s), i.e. the previous chunk owner's last w-1 tokens; the selection branch reads only
    # the n_sel blocks it picks; the compressed branch only the T/d compressed tokens. Gathering just
    # those instead of every raw k/v moves O(T/d + n_sel*l_sel + w) rows per query chunk, not O(T).
    outs, idxs = [], []
    for slot, s in enumerate(chunk_starts(seq_len, rank, world)):   # the two chunks, not tokens
        m = max(0, min(c, seq_len - s))                             # real queries of this chunk
        if m:
            S, lo = s + m, max(0, s - p.w + 1)
            n = num_cmp_tokens(S, p.l, p.d)
            args = (q[:, slot * c: slot * c + m], k_cmp[:, :n], v_cmp[:, :n], k_slc[:, :S], v_slc[:, :S],
                    k_win[:, lo:S], v_win[:, lo:S], gates[:, slot * c: slot * c + m])
            if validate:
                validate_inputs(dict(zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win",
                                          "gates"), args)), p, pos0=s, win_pos0=lo, decode=True)
            if used == "reference":
                o, idx = nsa_reference(*args, l=p.l, d=p.d, l_sel=p.l_sel, n_sel=p.n_sel, w=p.w,
                                       scale=sc, pos0=s, win_pos0=lo)
            elif used == "triton":   # s > 0: the offset route (route.offset_route); s = 0: plain prefill
                from nsa.ops.triton.function import nsa_triton_apply
                o, idx = nsa_triton_apply(*args, l=p.l, d=p.d, l_sel=p.l_sel, n_sel=p.n_sel, w=p.w, scale=sc,
                                          tuning=tuning, pos0=s, win_pos0=lo)
            else:
                o, idx = nsa_torch(*args, p=p, scale=sc, pos0=s, win_pos0=lo, tile=tile,
                                 checkpoint=recompute, tuning=tuning.torch)
            outs.append(o)
            idxs.append(idx)
        if m < c:   # padding rows past seq_len: zero output, no selected block
            outs.append(q.new_zeros(B, c - m, HQ, dv))
            idxs.append(torch.full((B, c - m, H, p.n_sel), -1, dtype=torch.int64, device=q.device))
    return torch.cat(outs, 1), torch.cat(idxs, 1)


def _check_local_rows(tensors: dict[str, torch.Tensor], rows: int, seq_len: int) -> None:
    for name, x in tensors.items():
        if x.dim() < 2 or x.shape[1] != rows:
            raise ValueError(f"{name} must hold 2*chunk_len = {rows} local positions (dim 1) for seq_len="
                             f"{seq_len}, got shape {tuple(x.shape)}; cut it with shard_sequence(x, rank, world)")


def cp_nsa_attention(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                     v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
                     seq_len: int, group=None, l: int = 32, d: int = 16, l_sel: int = 64, n_sel: int = 16,
                     w: int = 512, scale: float | None = None, backend: str | KernelPolicy = "auto",
                     tile: int | None = None, recompute: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """nsa_attention over a sequence of seq_len tokens sharded across the ranks of `group` (None:
    the default group); call it on every rank.

    Local (this rank's shard, shard_sequence): q [B,2c,HQ,dk], k_slc/v_slc/k_win/v_win [B,2c,H,dk|dv],
    gates [B,2c,HQ,3], c = chunk_len(seq_len, world). Replicated: k_cmp/v_cmp [B,N,H,dk|dv], the
    compressed tokens of the whole sequence (N = num_cmp_tokens(seq_len, l, d)), the same on every
    rank. Returns (o [B,2c,HQ,dv], block_idx [B,2c,H,n_sel]): the rows of the single-process op at
    this rank's positions; padded rows are 0 / -1. Gradients: q, gates and the raw k/v get exactly
    their rows' gradient (K/V gradients summed on their owner in rank order); k_cmp/v_cmp get this
    rank's queries' share, whose sum over ranks (an all-reduce, as for replicated parameters) is the
    single-process gradient. backend "reference" | "torch" | "triton" | "auto" or a KernelPolicy (triton: the
    Triton kernels' query-offset route, nsa/ops/route.py offset_route; tile / recompute are the torch path's).
    Every rank must run backward through `o`.
    """
    p = NSAParams(l, d, l_sel, n_sel, w)
    rank, world = _group_info(group)
    check_cp_length(seq_len, world)
    c = chunk_len(seq_len, world)
    local = dict(q=q, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win, gates=gates)
    _check_local_rows(local, 2 * c, seq_len)
    validate_inputs(dict(local, k_cmp=k_cmp, v_cmp=v_cmp), p, check_lengths=False)
    need = num_cmp_tokens(seq_len, l, d)
    for name, x in (("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        if x.shape[1] != need:
            raise ValueError(f"{name} must hold the whole sequence's N = num_cmp_tokens(seq_len={seq_len}, "
                             f"l={l}, d={d}) = {need} compressed tokens on every rank, got {x.shape[1]}")
    kv = gather_sequence([k_slc, v_slc, k_win, v_win], seq_len, group)
    return _local_attention(q, gates, k_cmp, v_cmp, kv, seq_len=seq_len, rank=rank, world=world, p=p,
                            scale=scale, backend=backend, tile=tile, recompute=recompute, validate=True)


# ---------------------------------------------------------------------------------------- layer
def cp_nsa_layer(layer, x_local: torch.Tensor, *, seq_len: int, group=None,
                 tile: int | None = None, recompute: bool | None = None) -> torch.Tensor:
    """NSAAttention `layer` (nsa/layers/attention.py, its own weights) on this rank's shard of a
    sequence: x_local [B, 2c, dim] (shard_sequence of x [B, seq_len, dim]) -> y_local [B, 2c, dim],
    the rows of layer(x) at this rank's positions (padded rows are 0). Call it on every rank.

    RoPE runs at the rows' absolute positions; the raw k/v of all three branches are gathered in
    one collective, so compression blocks that straddle chunk (and rank) boundaries see their
    tokens. Parameter gradients are this rank's share (its queries' contribution): all-reduce them
    (sum) over the group, as data parallelism does, to get the single-process gradient.
    """
    rank, world = _group_info(group)
    check_cp_length(seq_len, world)
    c = chunk_len(seq_len, world)
    if x_local.dim() != 3 or x_local.shape[1] != 2 * c or x_local.shape[2] != layer.dim:
        raise ValueError(f"x_local: expected [B, 2*chunk_len = {2 * c}, {layer.dim}] for seq_len={seq_len} "
                         f"over {world} ranks, got {tuple(x_local.shape)}; cut it with shard_sequence")
    B = x_local.shape[0]
    pr = layer.project(x_local, positions=local_positions(seq_len, rank, world, x_local.device))
    gates = layer.compute_gates(x_local)
    k_cmp_raw, v_cmp_raw, *kv = gather_sequence(
        [pr.k_cmp, pr.v_cmp, pr.k_slc, pr.v_slc, pr.k_win, pr.v_win], seq_len, group)
    # Every rank compresses all N blocks (phi is cheap next to attention); compressing only the blocks
    # that end in its own chunks and gathering those T/d tokens would replace the raw k_cmp/v_cmp gather.
    k_cmp, v_cmp = layer.phi_k(k_cmp_raw), layer.phi_v(v_cmp_raw)
    p = NSAParams(layer.l, layer.d, layer.l_sel, layer.n_sel, layer.w)
    o, block_idx = _local_attention(pr.q, gates, k_cmp, v_cmp, kv, seq_len=seq_len, rank=rank,
                                    world=world, p=p, scale=None, backend=layer.backend, tile=tile,
                                    recompute=recompute)
    c_end = max(min(s + c, seq_len) for s in chunk_starts(seq_len, rank, world) if s < seq_len)
    if c_end < layer.l <= seq_len:
        # no local query sees a compressed token, so phi would be missing from this rank's graph only;
        # DDP expects the same parameters to get gradients on every rank: add an exact zero through them
        o = o + 0.0 * (k_cmp.sum() + v_cmp.sum())
    if layer.record_stats:
        layer.last_gates, layer.last_block_idx = gates.detach(), block_idx.detach()
    return layer.o_proj(o.reshape(B, 2 * c, layer.n_heads * layer.d_v))


def _cp_forward(layer: NSAAttention, x: torch.Tensor, return_branches: bool = False, *, seq_len: int,
                group) -> torch.Tensor:
    if return_branches:
        raise ValueError("return_branches is not available under context parallelism; run the layer "
                         "on one process for branch diagnostics")
    return cp_nsa_layer(layer, x, seq_len=seq_len, group=group)


@contextlib.contextmanager
def context_parallel(model: nn.Module, *, seq_len: int, group=None) -> Iterator[nn.Module]:
    """Inside the block every NSAAttention of `model` runs cp_nsa_layer on its rank's shard, so
    model(shard_sequence(ids, rank, world)) gives this rank's rows of the logits [B, 2c, vocab]
    (everything else in a block is per token). Module names, parameters and state_dict are unchanged
    (the layers' forward is overridden per instance and restored on exit). Refuses a model with
    dense attention layers (no context-parallel path yet)."""
    if any(isinstance(m, DenseAttention) for m in model.modules()):
        raise ValueError("context_parallel: the model has dense attention layers (model.attention=dense), "
                         "which have no context-parallel path; use model.attention=nsa or "
                         "runtime.context_parallel=1")
    _, world = _group_info(group)
    check_cp_length(seq_len, world)
    layers = [m for m in model.modules() if isinstance(m, NSAAttention)]
    for m in layers:
        m.forward = partial(_cp_forward, m, seq_len=seq_len, group=group)
    try:
        yield model
    finally:
        for m in layers:
            del m.forward
