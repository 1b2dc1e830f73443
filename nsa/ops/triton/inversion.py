"""Inverting a selection: for each (batch, kv head, selection block), the list of tokens (or query
tiles) that chose it, split into work items of bounded length, so the block-order walks (dK/dV,
block-order forward) and the tile walks can run one program per item with no atomics.

Everything stays on the device (one sort, one searchsorted, a few small kernels) and nothing here
syncs with the host: sizes come from the shapes alone.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _toks_rank_kernel(ORDER, SKEY, TOKS, RANK, P, S, T, NSEG, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    """toks[i] = the token of sorted slot i (order[i] = flat (b, h, t, s) position); with RANKS also
    rank[order[i]] = i where the slot holds a block (sorted key < NSEG), else -1 (a permutation:
    every rank entry is written once)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P
    o = tl.load(ORDER + i, mask=ok, other=0).to(tl.int64)
    tl.store(TOKS + i, (o // S) % T, mask=ok)
    if RANKS:
        listed = tl.load(SKEY + i, mask=ok, other=0).to(tl.int64) < NSEG
        tl.store(RANK + o, tl.where(listed, i, -1), mask=ok)


def invert_selection(block_idx: torch.Tensor, l_sel: int, chunk: int, ranks: bool = False,
                     n_keys: int | None = None):
    """For each segment (b, h, block j): the tokens t that selected j, split in chunks of <= chunk.

    Device-only (sort + searchsorted, no host sync). Returns segment_lists' dict plus toks [P]
    (tokens, grouped by segment, ascending t within one); with ranks also rank [B,H,T,S] (the position
    of slot (b, h, t, s) in toks, -1 for an empty slot). n_keys: the keys the blocks cut (None: T; more
    for queries at an offset, whose blocks reach position offset + T - 1).
    """
    B, T, H, S = block_idx.shape
    inv = segment_lists(block_idx.permute(0, 2, 1, 3), triton.cdiv(n_keys or T, l_sel), chunk)   # [B, H, T, S]
    order, skey = inv.pop("order"), inv.pop("skey")
    P = order.numel()
    inv["toks"] = torch.empty_like(order)
    rank = torch.empty(B, H, T, S, device=order.device, dtype=order.dtype) if ranks else order
    if P:
        _toks_rank_kernel[(triton.cdiv(P, 1024),)](order, skey, inv["toks"], rank, P, S, T, inv["nseg"],
                                                   RANKS=ranks, BLOCK=1024)
    if ranks:
        inv["rank"] = rank
    return inv


@functools.lru_cache(maxsize=64)
def _segment_keys(B: int, H: int, nsb: int, kdt: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """segment_lists' per-shape constants, made once on the device: each (b, h)'s first key bh * nsb [B, H, 1, 1]
    int64 and the segment bounds 0..NSEG in kdt that the sorted keys are searched for."""
    return (torch.arange(B * H, device=dev, dtype=torch.int64).view(B, H, 1, 1) * nsb,
            torch.arange(B * H * nsb + 1, device=dev, dtype=kdt))


def segment_lists(blocks: torch.Tensor, nsb: int, chunk: int) -> dict:
    """blocks [B, H, N, S] (block ids of N entries of S slots each, -1 for none) -> for each segment
    (b, h, block j) the flat positions of the slots holding j, in (n, s) order, split in work items
    of <= chunk of them (the token walks of invert_selection, the tile walks of select_tile).

    Device-only. Returns order [P] (flat slot positions grouped by segment; slots holding no block
    last), skey [P] (their sorted keys: bh*nsb + block, NSEG for no block), segoff [NSEG+1], work_items'
    nch / xoff / wseg / wchunk / w_max / chunk, and the host ints n_slots, nseg, nsb, n_pairs."""
    B, H = blocks.shape[:2]
    dev = blocks.device
    nseg = B * H * nsb
    # the narrowest keys that fit: the radix sort makes 2 passes for int16, 4 for int32, 8 for int64
    kdt = torch.int16 if nseg < 2 ** 15 - 1 else torch.int32 if nseg < 2 ** 31 - 1 else torch.int64
    consts = _segment_keys if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()) \
        else _segment_keys.__wrapped__   # a capture only records the kernels that would fill a kept tensor
    bhn, bounds = consts(B, H, nsb, kdt, dev)
    # one copy casts the keys and lays them out in (b, h, n, s) order (blocks is a permuted view)
    key = torch.where(blocks >= 0, bhn + blocks, nseg).to(kdt, memory_format=torch.contiguous_format).view(-1)
    skey, order = torch.sort(key, stable=True)
    segoff = torch.searchsorted(skey, bounds)
    n_pairs = key.numel()
    if n_pairs + chunk >= 2 ** 31:
        raise ValueError(f"the selection has {n_pairs} (entry, slot) pairs: list positions are int32 in the "
                         "walks, so split the batch (B) into calls of fewer than 2**31 pairs")
    items = work_items(segoff, n_pairs, chunk)
    return dict(order=order, skey=skey, segoff=segoff,
                n_slots=max(1, (n_pairs + chunk - 1) // chunk), nseg=nseg, nsb=nsb, n_pairs=n_pairs, **items)


@triton.jit
def _seg_chunks_kernel(SEGOFF, NCH, CUM, XOFF, nseg, CHUNK, BLOCK: tl.constexpr):
    """One program over all segments (their count is small: B*H*n_blocks), in tiles of BLOCK with the
    running totals carried: nch[s] = max(ceil(count_s / CHUNK), 1), cum = inclusive prefix sum of nch,
    xoff = exclusive prefix sum of nch - 1 (int64, as the walks read them)."""
    base = (nseg * 0).to(tl.int64)
    xbase = base
    for s0 in range(0, nseg, BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ok = s < nseg
        cnt = tl.load(SEGOFF + s + 1, mask=ok, other=0).to(tl.int64) - tl.load(SEGOFF + s, mask=ok, other=0)
        nch = tl.where(ok, tl.maximum((cnt + CHUNK - 1) // CHUNK, 1), 0)
        extra = tl.where(ok, nch - 1, 0)
        tl.store(NCH + s, nch, mask=ok)
        tl.store(CUM + s, base + tl.cumsum(nch, 0), mask=ok)
        tl.store(XOFF + s, xbase + tl.cumsum(extra, 0) - extra, mask=ok)
        base += tl.sum(nch, 0)
        xbase += tl.sum(extra, 0)


@triton.jit
def _item_seg_kernel(CUM, NCH, WSEG, WCHUNK, nseg, w_max, LOGN: tl.constexpr, BLOCK: tl.constexpr):
    """Work item w -> (segment, chunk): wseg = the number of segments with cum <= w (a binary search of
    the inclusive prefix sum; nseg for a spare item past the last), wchunk = w - first item of
    min(wseg, nseg - 1)."""
    w = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = w < w_max
    lo = tl.zeros([BLOCK], tl.int64)
    hi = lo + nseg
    for _ in tl.static_range(LOGN):
        mid = (lo + hi) // 2
        live = lo < hi
        right = tl.load(CUM + mid, mask=live, other=0) <= w
        lo = tl.where(live & right, mid + 1, lo)
        hi = tl.where(live & ~right, mid, hi)
    segc = tl.minimum(lo, nseg - 1)
    first = tl.load(CUM + segc, mask=ok, other=0) - tl.load(NCH + segc, mask=ok, other=0)
    tl.store(WSEG + w, lo, mask=ok)
    tl.store(WCHUNK + w, w - first, mask=ok)


def work_items(segoff: torch.Tensor, n_pairs: int, chunk: int) -> dict:
    """Work items over an inversion's segments (segoff [NSEG+1]) in chunks of <= chunk list entries:
    nch [NSEG] (chunks per segment, >= 1: an empty block's one item writes its zero dK/dV), xoff [NSEG]
    (first fp32 scratch slot of a segment's chunks 1..), wseg / wchunk [w_max] (item -> segment, chunk;
    segment NSEG marks a spare item past the last one), w_max (a host int from the sizes alone: no
    sync), chunk. Device-only: two small kernels (they were a dozen torch ops)."""
    nseg = segoff.numel() - 1
    w_max = nseg + (n_pairs + chunk - 1) // chunk
    dev = segoff.device
    nch, cum, xoff = (torch.empty(max(nseg, 1), device=dev, dtype=torch.int64) for _ in range(3))
    wseg, wchunk = (torch.empty(w_max, device=dev, dtype=torch.int64) for _ in range(2))
    if nseg:
        _seg_chunks_kernel[(1,)](segoff, nch, cum, xoff, nseg, chunk, BLOCK=1024)
        _item_seg_kernel[(triton.cdiv(w_max, 1024),)](cum, nch, wseg, wchunk, nseg, w_max,
                                                      LOGN=nseg.bit_length(), BLOCK=1024)
    return dict(nch=nch[:nseg], xoff=xoff[:nseg], wseg=wseg, wchunk=wchunk, w_max=w_max, chunk=chunk)
