"""Query tiles of similar tokens instead of consecutive ones (TileTuning.group).

A query tile loads every block of its tokens' union of selections once and computes all of its rows
against it, rows of tokens that did not select a block masked. So a tile's cost follows its union size,
and m consecutive tokens are not the m tokens of their neighbourhood that share the most blocks. Here
the tokens of each window of W consecutive tokens (W a multiple of m) are reordered, per (batch, KV head),
so that each run of m positions holds tokens with similar selections: greedily, the first unplaced token
of the window opens a tile and the unplaced token adding the fewest new blocks to the tile's union joins
it (ties to the earlier token), until the tile has m tokens. The result is `perm` [B, H, T] int32, position
p of head h holding token perm[b, h, p], a permutation of each window (a partial last window keeps its
tokens in its first places). The tile kernels then read a tile's rows through perm, and its union is built
from the permuted block indices (`permuted`); every row still attends exactly its own token's blocks.

On captured selections of a trained model the unions of m=4 tiles shrink with the window W (docs/kernels.md,
tile.group).

One program per (window, b * H + h). Each token's selection is a bit mask of mask_bits(n_blocks) bits
(block id modulo that: exact up to 1024 blocks, i.e. 64k tokens at l_sel = 64; beyond, blocks 1024 apart
count as one, which only blurs the heuristic: any permutation is correct), [W, bits / 32] int32 in
registers; each of the W picks is a popcount of (mask & ~union) per token, a min and an OR.
`group_tokens_torch` is the same greedy on bool masks (the CPU path and the kernel's cross-check).

The greedy is cheap next to the op (an all-pairs compare per pick needed several times the registers); the
Hopper preset groups within W = 32, W = 64 was slower (docs/kernels.md, tile.group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2


MAX_WINDOW = 64      # windows W: powers of two up to this (the greedy's W picks are unrolled)
MAX_BITS = 1024      # block ids fold into this many bits per token (exact while every id is below it)


def mask_bits(n_blocks: int) -> int:
    """Bits of a token's selection mask for block ids < n_blocks: next_pow2(n_blocks) bits are exact; capped
    at MAX_BITS (ids fold modulo it: 64k tokens at l_sel = 64 still exact), at least one int32 word."""
    return max(32, min(MAX_BITS, next_pow2(n_blocks)))


@triton.jit
def _popc(v):
    """Set bits of each int32 (SWAR; every shift's sign bits are masked off before they count)."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    v = v + (v >> 8)
    v = v + (v >> 16)
    return v & 0x3F


@triton.jit
def _group_kernel(BI, PERM, sbb, sbt, sbh, T, H, W: tl.constexpr, M: tl.constexpr, S: tl.constexpr,
                  NW: tl.constexpr):
    win = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    i = tl.arange(0, W)
    wd = tl.arange(0, NW)
    tok = win * W + i
    real = tok < T
    row = BI + b * sbb + tok.to(tl.int64) * sbt + h * sbh
    mask = tl.zeros([W, NW], tl.int32)                     # [W, NW] each token's blocks as bits (id mod 32*NW)
    for s in tl.static_range(S):
        x = tl.load(row + s, mask=real, other=-1)           # [W] the tokens' s-th block
        hb = x & (NW * 32 - 1)
        bit = tl.where(x >= 0, 1 << (hb & 31), 0)
        mask = mask | tl.where((hb >> 5)[:, None] == wd[None, :], bit[:, None], 0)
    uni = tl.zeros([NW], tl.int32)                          # the open tile's union
    placed = tl.zeros([W], tl.int1)
    pos = tl.zeros([W], tl.int32)
    for p in tl.static_range(W):
        if p % M == 0:   # a new tile: the first unplaced real token (padding last)
            uni = tl.zeros([NW], tl.int32)
            key = tl.where(placed, 4 * W, tl.where(real, i, W + i))
        else:            # the unplaced token adding the fewest blocks; padding adds none but comes last
            added = tl.sum(_popc(mask & ~uni[None, :]), 1)
            key = tl.where(placed, (S + 2) * W + i, tl.where(real, added, S + 1) * W + i)
        j = tl.min(key, 0) % W
        placed = placed | (i == j)
        pos = tl.where(i == j, p, pos)
        uni = uni | tl.sum(tl.where((i == j)[:, None], mask, 0), 0)   # one row is non-zero: its bits
    tl.store(PERM + pid_bh.to(tl.int64) * T + win * W + pos, tok, mask=real & (win * W + pos < T))


def group_tokens(block_idx: torch.Tensor, m: int, window: int, n_blocks: int | None = None) -> torch.Tensor:
    """perm [B, H, T] int32 (module doc) for block_idx [B, T, H, n_sel] (-1 = unused slot, unit stride in
    n_sel); window W: a multiple of m, a power of two; n_blocks: a bound on the block ids (default T, which
    holds for any l_sel; the exact bound ceil(T / l_sel) makes the masks, hence the greedy, smaller). No
    host sync."""
    B, T, H, S = block_idx.shape
    if window % m or window & (window - 1) or window > MAX_WINDOW:
        raise ValueError(f"tile group window {window} must be a power of two <= {MAX_WINDOW} and a multiple "
                         f"of m={m}")
    nbits = mask_bits(T if n_blocks is None else n_blocks)
    if not block_idx.is_cuda:
        return group_tokens_torch(block_idx, m, window, nbits)
    perm = torch.empty(B, H, T, device=block_idx.device, dtype=torch.int32)
    _group_kernel[(triton.cdiv(T, window), B * H)](block_idx, perm, block_idx.stride(0), block_idx.stride(1),
                                                   block_idx.stride(2), T, H, W=window, M=m, S=S,
                                                   NW=nbits // 32, num_warps=4)
    return perm


def group_tokens_torch(block_idx: torch.Tensor, m: int, window: int, nbits: int | None = None) -> torch.Tensor:
    """group_tokens in torch ops, every window of every (b, h) at once: the same greedy, bits (default
    mask_bits(T)) and tie order."""
    B, T, H, S = block_idx.shape
    nw = -(-T // window)
    nbits = nbits or mask_bits(T)
    x = block_idx.permute(0, 2, 1, 3).to(torch.int64)                      # [B, H, T, S]
    x = torch.nn.functional.pad(x, (0, 0, 0, nw * window - T), value=-1).reshape(B, H, nw, window, S)
    mask = torch.zeros(B, H, nw, window, nbits + 1, dtype=torch.bool, device=x.device)
    mask.scatter_(-1, torch.where(x >= 0, x % nbits, nbits), True)          # unused slots set the spare bit
    mask = mask[..., :nbits]
    i = torch.arange(window, device=x.device)
    real = (torch.arange(nw * window, device=x.device) < T).view(nw, window)
    uni = torch.zeros(B, H, nw, nbits, dtype=torch.bool, device=x.device)
    placed = torch.zeros(B, H, nw, window, dtype=torch.bool, device=x.device)
    pos = torch.zeros(B, H, nw, window, dtype=torch.int64, device=x.device)
    for p in range(window):
        if p % m == 0:
            uni = torch.zeros_like(uni)
            key = torch.where(placed, 4 * window, torch.where(real, i, window + i))
        else:
            added = (mask & ~uni[..., None, :]).sum(-1)
            key = torch.where(placed, (S + 2) * window + i, torch.where(real, added, S + 1) * window + i)
        pick = i == key.min(-1, keepdim=True).values % window              # [B, H, nw, window]
        placed |= pick
        pos = torch.where(pick, p, pos)
        uni |= (mask & pick[..., None]).any(-2)
    tok = torch.arange(nw * window, device=x.device).view(nw, window).expand(B, H, nw, window)
    dest = (torch.arange(nw, device=x.device)[:, None] * window + pos)      # position of each token
    perm = torch.full((B, H, nw * window), -1, dtype=torch.int64, device=x.device)
    perm.scatter_(-1, dest.reshape(B, H, -1), tok.reshape(B, H, -1))
    return perm[..., :T].to(torch.int32).contiguous()


def permuted(block_idx: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """block_idx [B, T, H, S] in perm's order: out[b, p, h] = block_idx[b, perm[b, h, p], h]."""
    idx = perm.permute(0, 2, 1).to(torch.int64)[..., None].expand(-1, -1, -1, block_idx.shape[3])
    return torch.gather(block_idx, 1, idx).contiguous()
