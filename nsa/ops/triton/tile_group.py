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

Captured selections of a trained model (paper shape, 64k, H200, bench/RESULTS.md table 26): the union of
m=4 tiles falls from 0.537 of m x n_sel (consecutive) to 0.495 / 0.455 / 0.422 for W = 8 / 16 / 32 on
layer 0, 0.422 to 0.400 / 0.377 / 0.361 on layer 3.

One program per (window, b * H + h); the greedy runs on [W, n_sel] registers: whether each of the window's
entries is in the open tile's union is updated by an all-pairs compare with each new member's n_sel blocks
(W * n_sel * n_sel per member). `group_tokens_torch` is the same greedy in torch (the CPU path and the
kernel's cross-check).

Whole op, same table, graph-timed forward+backward on those captures (the Gluon tile kernels): 64k layer 0
82.09 -> 80.72 / 79.80 / 80.42 ms for W = 8 / 16 / 32 (-2.8% at 16), but layer 3 76.06 -> 76.40 / 76.52 /
76.99 and 8k +0.05-0.3 ms on both layers: where the unions shrink little, the greedy's own time (its W
picks each compare the window's W x n_sel entries with n_sel blocks) outweighs the smaller tiles. Hence
off in every preset; a cheaper greedy (pairwise overlaps computed once per window) is the next step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import next_pow2


@triton.jit
def _group_kernel(BI, PERM, sbb, sbt, sbh, T, H, W: tl.constexpr, M: tl.constexpr, S: tl.constexpr,
                  SP: tl.constexpr):
    win = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    i = tl.arange(0, W)
    s = tl.arange(0, SP)
    tok = win * W + i
    real = tok < T
    x = tl.load(BI + b * sbb + tok.to(tl.int64)[:, None] * sbt + h * sbh + s[None, :],
                mask=real[:, None] & (s[None, :] < S), other=-1)            # [W, SP] the tokens' blocks
    valid = x >= 0
    in_u = tl.zeros([W, SP], tl.int1)                                       # entry's block in the open union
    placed = tl.zeros([W], tl.int1)
    pos = tl.zeros([W], tl.int32)
    for p in tl.static_range(W):
        if p % M == 0:   # a new tile: the first unplaced real token (padding last)
            in_u = tl.zeros([W, SP], tl.int1)
            key = tl.where(placed, 4 * W, tl.where(real, i, W + i))
        else:            # the unplaced token adding the fewest blocks; padding adds none but comes last
            added = tl.sum((valid & ~in_u).to(tl.int32), 1)
            key = tl.where(placed, (S + 2) * W + i, tl.where(real, added, S + 1) * W + i)
        j = tl.min(key, 0) % W
        placed = placed | (i == j)
        pos = tl.where(i == j, p, pos)
        xj = tl.max(tl.where((i == j)[:, None], x, -1), 0)                 # [SP] the member's blocks
        hit = tl.sum(((x[:, :, None] == xj[None, None, :]) & (xj >= 0)[None, None, :]).to(tl.int32), 2)
        in_u = in_u | (hit > 0)
    tl.store(PERM + pid_bh.to(tl.int64) * T + win * W + pos, tok, mask=real & (win * W + pos < T))


def group_tokens(block_idx: torch.Tensor, m: int, window: int) -> torch.Tensor:
    """perm [B, H, T] int32 (module doc) for block_idx [B, T, H, n_sel] (-1 = unused slot, unit stride in
    n_sel); window W: a multiple of m, a power of two. No host sync."""
    B, T, H, S = block_idx.shape
    if window % m or window & (window - 1) or window > 32:
        raise ValueError(f"tile group window {window} must be a power of two <= 32 and a multiple of m={m}")
    if not block_idx.is_cuda:
        return group_tokens_torch(block_idx, m, window)
    perm = torch.empty(B, H, T, device=block_idx.device, dtype=torch.int32)
    _group_kernel[(triton.cdiv(T, window), B * H)](block_idx, perm, block_idx.stride(0), block_idx.stride(1),
                                                   block_idx.stride(2), T, H, W=window, M=m, S=S,
                                                   SP=max(2, next_pow2(S)), num_warps=4)
    return perm


def group_tokens_torch(block_idx: torch.Tensor, m: int, window: int) -> torch.Tensor:
    """group_tokens in torch ops, every window of every (b, h) at once: the same greedy and tie order."""
    B, T, H, S = block_idx.shape
    nw = -(-T // window)
    x = block_idx.permute(0, 2, 1, 3)                                       # [B, H, T, S]
    x = torch.nn.functional.pad(x, (0, 0, 0, nw * window - T), value=-1).reshape(B, H, nw, window, S)
    i = torch.arange(window, device=x.device)
    real = (torch.arange(nw * window, device=x.device) < T).view(nw, window)
    valid = x >= 0
    in_u = torch.zeros_like(valid)
    placed = torch.zeros(B, H, nw, window, dtype=torch.bool, device=x.device)
    pos = torch.zeros(B, H, nw, window, dtype=torch.int64, device=x.device)
    for p in range(window):
        if p % m == 0:
            in_u = torch.zeros_like(valid)
            key = torch.where(placed, 4 * window, torch.where(real, i, window + i))
        else:
            added = (valid & ~in_u).sum(-1)
            key = torch.where(placed, (S + 2) * window + i, torch.where(real, added, S + 1) * window + i)
        j = key.min(-1, keepdim=True).values % window                       # [B, H, nw, 1]
        pick = i == j
        placed |= pick
        pos = torch.where(pick, p, pos)
        xj = torch.where(pick[..., None], x, -1).max(-2).values             # [B, H, nw, S]
        hit = ((x[..., :, None] == xj[..., None, None, :]) & (xj >= 0)[..., None, None, :]).any(-1)
        in_u |= hit
    tok = torch.arange(nw * window, device=x.device).view(nw, window).expand(B, H, nw, window)
    dest = (torch.arange(nw, device=x.device)[:, None] * window + pos)      # position of each token
    perm = torch.full((B, H, nw * window), -1, dtype=torch.int64, device=x.device)
    perm.scatter_(-1, dest.reshape(B, H, -1), tok.reshape(B, H, -1))
    return perm[..., :T].to(torch.int32).contiguous()


def permuted(block_idx: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """block_idx [B, T, H, S] in perm's order: out[b, p, h] = block_idx[b, perm[b, h, p], h]."""
    idx = perm.permute(0, 2, 1).to(torch.int64)[..., None].expand(-1, -1, -1, block_idx.shape[3])
    return torch.gather(block_idx, 1, idx).contiguous()
