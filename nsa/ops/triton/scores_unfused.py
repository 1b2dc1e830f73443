"""Selection-block choice in two steps: the block-score tensor, then the top-n (a cross-check).

The op chooses blocks with scores.select_blocks, which fuses both steps and never stores the score
tensor; this unfused path is kept as an independent cross-check (tests, benchmarks) and must keep
giving the same block_idx.

Scores.  p_cmp[t, hq, i] = exp(q k~_i * scale - lse_cmp) is recomputed per compressed token and
mapped to selection blocks with the overlap weights: block j collects ``cnt(i, j)`` = number of
stride chunks (d tokens) that compression block i shares with j, i.e. overlap(i, j) / d. A program
handles a (token tile x group heads) row tile and a run of NBJ selection blocks at a time, loading
exactly the compressed tokens that overlap them (NBJ*R + LC - 1 <= BN, R = l_sel/d, LC = l/d), so
every block score is produced once, summed over the group's heads, and written to a
[B, H, T, n_blocks] fp32 tensor. No [HQ, T, N] probability tensor is ever stored.

Top-n.  One more kernel ranks blocks exactly like nsa.ops.reference: scores are put on the integer
grid round(s * 2**20 * d / (G*l)) (fp64, half to even), forced blocks get a priority bonus (block of
t > block 0 > block before), ties go to the lower index; output ascending, -1 padded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import FORCED_STEP, LOG2E
from ._utils import dot_precision, next_pow2, row_block
from .attn import load_group, token_rows
from .scores import SCORE_GRID


@triton.jit
def _scores_kernel(Q, KC, LSE, SC, sqb, sqt, sqh, skb, skt, skh,
                   T, N, H, NSB, scale_log2,
                   G: tl.constexpr, GP: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr,
                   LSEL: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, BLOCK_R: tl.constexpr,
                   BN: tl.constexpr, NBJ: tl.constexpr, NBJ_PAD: tl.constexpr, DOT_PREC: tl.constexpr,
                   P_PREC: tl.constexpr):
    BT: tl.constexpr = BLOCK_R // GP
    R: tl.constexpr = LSEL // STRIDE      # stride chunks per selection block
    LC: tl.constexpr = L_CMP // STRIDE    # stride chunks per compression block
    pid_m = tl.program_id(0)
    b, h, tok, row_ok, hq, tok64 = token_rows(pid_m, tl.program_id(1), T, H, G, GP, BLOCK_R)
    offs_dk = tl.arange(0, BDK)
    q = load_group(Q, b, tok64[:, None], hq, row_ok, offs_dk, sqb, sqt, sqh, DK)
    lse = tl.load(LSE + (b * T + tok64) * (H * G) + hq, mask=row_ok, other=0.0) * 1.4426950408889634
    ttok = pid_m * BT + tl.arange(0, BT)                 # [BT] tokens of the tile
    t_last = tl.minimum(pid_m * BT + BT - 1, T - 1)
    nsb_tile = t_last // LSEL + 1                        # blocks eligible for some token of the tile
    cols = tl.arange(0, NBJ_PAD)
    kc_base = KC + b * skb + h * skh
    sc_base = SC + ((b * H + h) * T + ttok.to(tl.int64)) * NSB   # [BT]
    for j0 in range(0, nsb_tile, NBJ):
        ki = j0 * R - (LC - 1) + tl.arange(0, BN)       # compressed tokens overlapping blocks j0..
        k_ok = (ki >= 0) & (ki < N)
        k = tl.load(kc_base + ki.to(tl.int64)[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2          # [R, BN]
        vis = ((ki * STRIDE + L_CMP - 1)[None, :] <= tok[:, None]) & k_ok[None, :] & row_ok[:, None]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        p_tok = tl.sum(tl.reshape(p, [BT, GP, BN]), 1)   # [BT, BN] summed over the group's heads
        jj = j0 + cols                                   # [NBJ_PAD] absolute block ids
        lo = tl.maximum(ki[:, None], (jj * R)[None, :])
        hi = tl.minimum(ki[:, None] + LC - 1, (jj * R + R - 1)[None, :])
        cnt = tl.where((hi >= lo) & (cols < NBJ)[None, :], hi - lo + 1, 0).to(tl.float32)  # [BN, NBJ_PAD]
        if BT >= 16:   # many tokens per tile (small G): tensor cores, ~fp32 accurate
            stok = tl.dot(p_tok, cnt, input_precision=P_PREC)       # [BT, NBJ_PAD]
        else:          # few tokens: exact fp32 on CUDA cores, [BT, BN, NBJ_PAD] is small
            stok = tl.sum(p_tok[:, :, None] * cnt[None, :, :], 1)
        mask = (ttok < T)[:, None] & (cols < NBJ)[None, :] & (jj < NSB)[None, :]
        tl.store(sc_base[:, None] + jj[None, :], stok, mask=mask)


def block_scores(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, *, l: int, d: int,
                 l_sel: int, scale: float, exact: bool = True) -> torch.Tensor:
    """q [B,T,HQ,dk], k_cmp [B,N,H,dk], lse_cmp fp32 [B,T,HQ] -> scores fp32 [B,H,T,ceil(T/l_sel)].

    Entries of blocks not eligible for a token (j*l_sel > t) may be left unwritten."""
    B, T, HQ, dk = q.shape
    N, H = k_cmp.shape[1], k_cmp.shape[2]
    G = HQ // H
    GP = next_pow2(G)
    nsb = triton.cdiv(T, l_sel)
    R, LC = l_sel // d, l // d
    bn = max(64, next_pow2(R + LC - 1))
    nbj = (bn - LC + 1) // R
    bdk = max(16, next_pow2(dk))
    block_r = row_block(GP, 64 if bdk <= 128 else 32)
    sc = torch.empty(B, H, T, nsb, device=q.device, dtype=torch.float32)
    # p @ cnt needs ~fp32 accuracy for the selection to match fp32/fp64 paths: 3 tf32 passes on GPU
    prec = ("tf32x3" if exact else "tf32") if q.is_cuda else "ieee"
    grid = (triton.cdiv(T, block_r // GP), B * H)
    _scores_kernel[grid](q, k_cmp, lse_cmp.contiguous(), sc, q.stride(0), q.stride(1), q.stride(2),
                         k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), T, N, H, nsb, scale * LOG2E,
                         G=G, GP=GP, L_CMP=l, STRIDE=d, LSEL=l_sel, DK=dk, BDK=bdk, BLOCK_R=block_r,
                         BN=bn, NBJ=nbj, NBJ_PAD=max(16, next_pow2(nbj)),
                         DOT_PREC=dot_precision(q.dtype, q.is_cuda), P_PREC=prec,
                         num_warps=8 if bdk >= 128 else 4, num_stages=2)
    return sc


# ----------------------------------------------------------------------------------------------
# top-n


@triton.jit
def _topn_kernel(SC, BI, sbb, sbt, sbh, T, H, NSB,
                 G: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr, LSEL: tl.constexpr,
                 NSEL: tl.constexpr, NSB_P2: tl.constexpr, BT: tl.constexpr, FSTEP: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    t = pid_t * BT + tl.arange(0, BT)                    # [BT]
    t_ok = t < T
    j = tl.arange(0, NSB_P2)                             # [NSB_P2]
    cur = t // LSEL
    elig = (j[None, :] <= cur[:, None]) & (j < NSB)[None, :] & t_ok[:, None]
    s = tl.load(SC + ((b * H + h) * T + t.to(tl.int64))[:, None] * NSB + j[None, :], mask=elig, other=0.0)
    # comparison grid of nsa.ops.common: round-half-even(s * 2**SCORE_BITS * d / (G*l)) in fp64
    mult = tl.full([1, 1], SCORE_GRID * STRIDE, tl.float64) / (G * L_CMP)
    x = s.to(tl.float64) * mult
    grid = ((x + 4503599627370496.0) - 4503599627370496.0).to(tl.int32)   # rint for 0 <= x < 2**52
    jb = j[None, :]
    prio = tl.where(jb == cur[:, None], 3, tl.where(jb == 0, 2, tl.where(jb == cur[:, None] - 1, 1, 0)))
    key = tl.where(elig, prio * FSTEP + grid, -1)        # [BT, NSB_P2]
    sel = tl.zeros([BT, NSB_P2], tl.int32)
    for _ in range(NSEL):
        m = tl.max(key, 1)
        jm = tl.min(tl.where(key == m[:, None], jb, NSB_P2), 1)   # lowest index among the maxima
        hit = (jb == jm[:, None]) & (m[:, None] >= 0)
        sel = tl.where(hit, 1, sel)
        key = tl.where(hit, -2, key)
    pos = tl.cumsum(sel, 1) - 1
    out = BI + b * sbb + t.to(tl.int64) * sbt + h * sbh
    for slot in range(NSEL):
        js = tl.max(tl.where((sel > 0) & (pos == slot), jb, -1), 1)
        tl.store(out + slot, js.to(tl.int64), mask=t_ok)


def select_topn(scores: torch.Tensor, *, G: int, l: int, d: int, l_sel: int, n_sel: int) -> torch.Tensor:
    """scores fp32 [B,H,T,n_blocks] -> block_idx int64 [B,T,H,n_sel] (ascending, -1 padded)."""
    B, H, T, nsb = scores.shape
    bi = torch.empty(B, T, H, n_sel, device=scores.device, dtype=torch.int64)
    nsb_p2 = max(16, next_pow2(nsb))
    bt = max(1, min(16, 8192 // nsb_p2))
    _topn_kernel[(triton.cdiv(T, bt), B * H)](scores, bi, bi.stride(0), bi.stride(1), bi.stride(2), T, H, nsb,
                                              G=G, L_CMP=l, STRIDE=d, LSEL=l_sel, NSEL=n_sel, NSB_P2=nsb_p2,
                                              BT=bt, FSTEP=FORCED_STEP, num_warps=4)
    return bi
