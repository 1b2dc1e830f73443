"""Selection-block choice in one pass: importance scores and the top-n, fused (forward path).

The selected blocks are computed without ever writing the [B, H, T, n_blocks] score tensor.

Tiling.  One program per (tile of BT tokens, b, kv head). Its rows are (token, head-of-group) pairs,
BLOCK_R = BT * GP of them (row r -> token t0 + r // GP, query head h*G + r % GP, as in attn.py), so
q . k~^T is one [BLOCK_R, d_k] x [d_k, BN] tensor-core product per step whatever G is. A step
("chunk") covers NBJ consecutive selection blocks j0 .. j0+NBJ-1 and loads exactly the BN compressed
tokens that can overlap them (j0*R - (LC-1) ..., R = l_sel/d, LC = l/d; BN >= NBJ*R + LC - 1). There:
  p   = exp2(q k~ * scale*log2e - lse*log2e)               [BLOCK_R, BN] (recomputed p_cmp)
  s   = sum over the group's heads of p @ cnt              [BT, NBJ_PAD]
where cnt[i, j] = overlap(i, j) / d, the number of stride chunks compression block i shares with
selection block j (a band matrix, the same for every chunk relative to j0). On the GPU p @ cnt runs
on tensor cores as two fp16 products (~22-bit p, the accuracy class of the unfused kernel's tf32x3): p is
formed as 2**12 p (the 12 folded into lse, so no multiply), split hi + lo in fp16, and both products take
cnt * 2**-12 (exact in fp16), accumulating into one fp32 result; the exact fp32 CUDA-core map is an
option (MAP 0). The causal mask (and the k~ < 0 / >= N guards) is only applied on chunks that need it:
chunks fully visible to the tile's first token run an unmasked loop. Tiles are launched heaviest
(latest tokens) first.

Top-n.  Scores go on the integer grid of nsa.ops.common (round-half-even(s * 2**20 * d / (G*l)) in
fp64), exactly as scores_unfused._topn_kernel does. Forced blocks (block of t, block 0, the one before) are
kept out of the running set; every other eligible block j (1 <= j <= t//l_sel - 2) becomes the key
grid * 2**IB + (2**IB - 1 - j), so a larger key is a better block and equal grids prefer the lower
index (IB = index bits; keys are int32 when 21 + IB <= 31, else int64). Each token keeps its best KR
(= next_pow2(n_sel)) keys sorted descending; a chunk's keys are bitonic-sorted ascending, folded to
their best KR, and merged with max(run, new) (the top KR of the union, a bitonic sequence) plus one
bitonic merge. At the end forced blocks are placed by priority, the best n_sel - #forced others fill
the rest, and the row is sorted ascending and -1 padded: the same block_idx as
scores_unfused.block_scores + select_topn and nsa.ops.reference (on the GPU up to rounding-level near
ties of fp32 scores: at T=64k, HQ=64, H=4, 1 row in 262144 differs from the unfused kernels).

Query offset (QOFF, select_blocks' q_off): query row r sits at position r + QOFF (a context-parallel chunk);
the causal mask, the block of each token and its candidates use that position, the rows stay r.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import LOG2E, SCORE_BITS, SCORE_MAP_SHIFT
from ..tuning import EXACT_SCORES, ScoreTuning
from ._utils import dot_precision, next_pow2, reg_cap, row_block
from .attn import load_group, token_rows

GRID_BITS = SCORE_BITS + 1   # grid values are <= 2**SCORE_BITS (+1 by rounding) < 2**GRID_BITS
SCORE_GRID = tl.constexpr(float(2 ** SCORE_BITS))   # the score grid of nsa/ops/common.py, for the kernels
MAP_SHIFT = tl.constexpr(float(SCORE_MAP_SHIFT))   # the fp16 map's p is 2**MAP_SHIFT p (nsa/ops/common.py)
MAP_SCALE = tl.constexpr(2.0 ** -SCORE_MAP_SHIFT)   # ... and its counts cnt * 2**-MAP_SHIFT


# ----------------------------------------------------------------------------------------------
# bitonic networks on the last axis of [BT, K] integer tensors (K a power of two)


@triton.jit
def _cmpx(x, BT: tl.constexpr, K: tl.constexpr, S: tl.constexpr, BLK: tl.constexpr, DESC: tl.constexpr):
    """Compare-exchange of elements i and i ^ S; ascending where bit BLK of i is 0 (reversed by DESC)."""
    y = tl.reshape(x, [BT, K // (2 * S), 2, S])
    # the pair's sum minus self (integer wrap-around is harmless); tl.sum, unlike xor_sum, is native
    # in Triton's interpreter
    partner = tl.sum(y, 2, keep_dims=True) - y
    a = tl.arange(0, K // (2 * S))[None, :, None, None]
    r = tl.arange(0, 2)[None, None, :, None]
    flip = ((a // (BLK // (2 * S))) + r + DESC) % 2
    y = tl.where((y > partner) != (flip == 1), partner, y)
    return tl.reshape(y, [BT, K])


@triton.jit
def _bitonic_sort(x, BT: tl.constexpr, K: tl.constexpr, LOGK: tl.constexpr, DESC: tl.constexpr):
    for i in tl.static_range(1, LOGK + 1):
        for jj in tl.static_range(0, i):
            x = _cmpx(x, BT, K, 1 << (i - 1 - jj), 1 << i, DESC)
    return x


@triton.jit
def _bitonic_merge(x, BT: tl.constexpr, K: tl.constexpr, LOGK: tl.constexpr, DESC: tl.constexpr):
    """Sorts a bitonic sequence."""
    for jj in tl.static_range(0, LOGK):
        x = _cmpx(x, BT, K, 1 << (LOGK - 1 - jj), 2 * K, DESC)
    return x


@triton.jit
def _cmpx_rows(x, ROWS: tl.constexpr, K: tl.constexpr, S: tl.constexpr, desc):
    """One bitonic-merge step (pairs i, i ^ S) of each row of x [ROWS, K], direction per row."""
    y = tl.reshape(x, [ROWS, K // (2 * S), 2, S])
    partner = tl.sum(y, 2, keep_dims=True) - y              # as in _cmpx
    flip = (tl.arange(0, 2)[None, None, :, None] + desc[:, None, None, None]) % 2
    y = tl.where((y > partner) != (flip == 1), partner, y)
    return tl.reshape(y, [ROWS, K])


@triton.jit
def _merge_rows(x, ROWS: tl.constexpr, K: tl.constexpr, LOGK: tl.constexpr, desc):
    """Sorts each bitonic row of x [ROWS, K]; row i descending where desc[i] == 1, else ascending."""
    for jj in tl.static_range(0, LOGK):
        x = _cmpx_rows(x, ROWS, K, 1 << (LOGK - 1 - jj), desc)
    return x


# ----------------------------------------------------------------------------------------------
# per-chunk pieces


@triton.jit
def _block_sums(p, cnt, BT: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, NBJ_PAD: tl.constexpr,
                MAP: tl.constexpr, P_PREC: tl.constexpr):
    """p [BLOCK_R, BN] fp32, cnt [BN, NBJ_PAD] -> per-token block scores [BT, NBJ_PAD] fp32."""
    if MAP == 0:
        if GP > 1:
            p = tl.sum(tl.reshape(p, [BT, GP, BN]), 1)                      # [BT, BN]
        if BT >= 16:   # Triton (3.6) rewrites the multiply-sum below into a TF32 dot when M, N >= 16
            y = tl.dot(p, cnt, input_precision="ieee")   # (it changed 1.5% of the rows at 64k)
        else:
            y = tl.sum(p[:, :, None] * cnt[None, :, :], 1)
    else:
        if MAP == 1:
            y = tl.dot(p, cnt, input_precision=P_PREC)                      # [BLOCK_R, NBJ_PAD]
        else:   # p arrives as 2**12 p (MAP_SHIFT off lse): hi + lo to ~22 bits, cnt * 2**-12 exact in fp16
            hi = p.to(tl.float16)
            lo = (p - hi.to(tl.float32)).to(tl.float16)
            c16 = (cnt * MAP_SCALE).to(tl.float16)
            y = tl.dot(lo, c16, out_dtype=tl.float32)
            y = tl.dot(hi, c16, y, out_dtype=tl.float32)
        if GP > 1:
            y = tl.sum(tl.reshape(y, [BT, GP, NBJ_PAD]), 1)
    return y


@triton.jit
def _merge_chunk(run, s, j0, cur, BT: tl.constexpr, NBJ: tl.constexpr, NBJ_PAD: tl.constexpr,
                 KR: tl.constexpr, LOGKR: tl.constexpr, LOGNB: tl.constexpr, IB: tl.constexpr,
                 KEY64: tl.constexpr, G: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr,
                 SCR, RELAY: tl.constexpr):
    """run [BT, KR] best keys so far (descending); s [BT, NBJ_PAD] scores of blocks j0.. -> new run.
    RELAY: s goes through this program's scratch SCR [BT * NBJ_PAD] fp32 first. The head sum leaves s
    in the MMA rows' layout, every element held by the lanes that held its heads (8 copies at G=16 on
    8 warps); loaded back it is spread over the threads, so the keys and the sorting network below run
    once per element instead of once per copy (sm_90, 128-row tile: the unmasked loop 566 -> 432
    instructions per thread at G=16, d=128; 692 -> 408 at G=6, d=64)."""
    if RELAY:
        r_ = tl.arange(0, BT)[:, None] * NBJ_PAD + tl.arange(0, NBJ_PAD)[None, :]
        tl.store(SCR + r_, s)
        tl.debug_barrier()    # every thread's store lands before any thread loads
        s = tl.load(SCR + r_)
        tl.debug_barrier()    # and every load before the next chunk overwrites
    cols = tl.arange(0, NBJ_PAD)
    jj = (j0 + cols).to(tl.int64)                                            # [NBJ_PAD]
    mult = tl.full([1, 1], SCORE_GRID * STRIDE, tl.float64) / (G * L_CMP)
    x = s.to(tl.float64) * mult
    grid = ((x + 4503599627370496.0) - 4503599627370496.0).to(tl.int64)   # rint for 0 <= x < 2**52
    key = (grid << IB) + (((1 << IB) - 1) - jj)[None, :]
    ok = (cols < NBJ)[None, :] & (jj >= 1)[None, :] & (jj[None, :] <= (cur - 2)[:, None])
    key = tl.where(ok, key, -1)
    if not KEY64:
        key = key.to(tl.int32)
    return _merge_keys(run, key, BT, NBJ_PAD, KR, LOGKR, LOGNB)


@triton.jit
def _merge_keys(run, key, BT: tl.constexpr, NBJ_PAD: tl.constexpr, KR: tl.constexpr,
                LOGKR: tl.constexpr, LOGNB: tl.constexpr):
    new = _bitonic_sort(key, BT, NBJ_PAD, LOGNB, 0)                         # ascending
    if NBJ_PAD > KR:   # sorted ascending: the last KR-slice is the elementwise max of all slices
        new = tl.max(tl.reshape(new, [BT, NBJ_PAD // KR, KR]), 1)
    return _bitonic_merge(tl.maximum(run, new), BT, KR, LOGKR, 1)           # descending


@triton.jit
def _scan(run, q, lse2, tok, cur, cnt, kc_base, skt, c_lo, c_hi, N, scale_log2,
          G: tl.constexpr, GP: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr,
          R: tl.constexpr, LC: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr, BT: tl.constexpr,
          BN: tl.constexpr, NBJ: tl.constexpr, NBJ_PAD: tl.constexpr, KR: tl.constexpr,
          LOGKR: tl.constexpr, LOGNB: tl.constexpr, IB: tl.constexpr, KEY64: tl.constexpr,
          MAP: tl.constexpr, P_PREC: tl.constexpr, DOT_PREC: tl.constexpr,
          MASKED: tl.constexpr, SCR, RELAY: tl.constexpr):
    """Chunks c_lo .. c_hi-1. MASKED=False only for chunks whose loaded tokens all exist (>= 0, < N)
    and are visible to every token of the tile."""
    offs_dk = tl.arange(0, BDK)
    for c in range(c_lo, c_hi):
        j0 = c * NBJ
        ki = j0 * R - (LC - 1) + tl.arange(0, BN)                            # [BN] compressed tokens
        k_ok = (ki >= 0) & (ki < N)
        k = tl.load(kc_base + ki.to(tl.int64)[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)   # [BN, BDK]
        x = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2 - lse2[:, None]
        if MASKED:
            vis = ((ki * STRIDE + L_CMP - 1)[None, :] <= tok[:, None]) & k_ok[None, :]
            p = tl.where(vis, tl.exp2(x), 0.0)
        else:
            p = tl.exp2(x)
        s = _block_sums(p, cnt, BT, GP, BN, NBJ_PAD, MAP, P_PREC)
        run = _merge_chunk(run, s, j0, cur, BT, NBJ, NBJ_PAD, KR, LOGKR, LOGNB, IB, KEY64,
                           G, L_CMP, STRIDE, SCR, RELAY)
    return run


@triton.jit
def store_blocks(run, cur, ttok, BI, b, h, sbb, sbt, sbh, T, NSEL: tl.constexpr, BT: tl.constexpr,
                 KR: tl.constexpr, LOGKR: tl.constexpr, IB: tl.constexpr):
    """Each token's row of block_idx from its running best keys run [BT, KR]: the forced blocks by priority (cur,
    0, cur-1; min(cur+1, 3) distinct), then the best others, sorted ascending and -1 padded."""
    pos = tl.arange(0, KR)[None, :]
    nf = tl.minimum(cur + 1, 3)[:, None]
    base = tl.maximum(NSEL - nf, 0)
    kf = pos - base
    jrun = (((1 << IB) - 1) - (run & ((1 << IB) - 1))).to(tl.int32)
    big = 2147483647
    val = tl.where((pos < base) & (run >= 0), jrun, big)
    forced = tl.where(kf == 0, cur[:, None], tl.where(kf == 1, 0, cur[:, None] - 1))
    val = tl.where((kf >= 0) & (kf < tl.minimum(nf, NSEL)), forced, val)
    val = _bitonic_sort(val, BT, KR, LOGKR, 0)
    out = tl.where(val == big, -1, val).to(tl.int64)
    tl.store(BI + b * sbb + ttok.to(tl.int64)[:, None] * sbt + h * sbh + pos, out,
             mask=(ttok < T)[:, None] & (pos < NSEL))


# ----------------------------------------------------------------------------------------------
# kernel


@triton.jit
def _select_kernel(Q, KC, LSE, BI, SCRATCH, sqb, sqt, sqh, skb, skt, skh, sbb, sbt, sbh,
                   T, N, H, n_tiles, QOFF, scale_log2,
                   G: tl.constexpr, GP: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr,
                   LSEL: tl.constexpr, NSEL: tl.constexpr, DK: tl.constexpr, BDK: tl.constexpr,
                   BLOCK_R: tl.constexpr, BN: tl.constexpr, NBJ: tl.constexpr, NBJ_PAD: tl.constexpr,
                   KR: tl.constexpr, LOGKR: tl.constexpr, LOGNB: tl.constexpr, IB: tl.constexpr,
                   KEY64: tl.constexpr, MAP: tl.constexpr, P_PREC: tl.constexpr, DOT_PREC: tl.constexpr,
                   RELAY: tl.constexpr):
    BT: tl.constexpr = BLOCK_R // GP
    R: tl.constexpr = LSEL // STRIDE       # stride chunks per selection block
    LC: tl.constexpr = L_CMP // STRIDE     # stride chunks per compression block
    pid_m = n_tiles - 1 - tl.program_id(0)          # latest (most blocks) tiles first
    pid_bh = tl.program_id(1)
    b, h, tok, row_ok, hq, tok64 = token_rows(pid_m, pid_bh, T, H, G, GP, BLOCK_R)   # [BLOCK_R]
    q = load_group(Q, b, tok64[:, None], hq, row_ok, tl.arange(0, BDK), sqb, sqt, sqh, DK)   # [BLOCK_R, BDK]
    lse = tl.load(LSE + (b * T + tok64) * (H * G) + hq, mask=row_ok, other=0.0)
    # +inf for padding rows and rows that see no compressed token: their p is exactly 0. The fp16 map (MAP 2)
    # takes 2**12 p: its lo part then needs no scaling, and p >= 2**-26 stays normal in fp16
    lse2 = tl.where(row_ok & (lse > float("-inf")), lse * 1.4426950408889634 - (MAP_SHIFT if MAP == 2 else 0.0),
                    float("inf"))
    tpos = tok + QOFF                                                        # [BLOCK_R] query positions
    ttok = pid_m * BT + tl.arange(0, BT)                                     # [BT] query rows
    cur = (ttok + QOFF) // LSEL                                              # block of each token's position
    t_first = QOFF + pid_m * BT                                              # positions: row + QOFF
    t_last = QOFF + tl.minimum(pid_m * BT + BT - 1, T - 1)
    n_ch = tl.cdiv(tl.maximum(t_last // LSEL - 1, 0), NBJ)   # candidates are blocks <= cur - 2
    nv_first = tl.where(t_first >= L_CMP - 1, (t_first - (L_CMP - 1)) // STRIDE + 1, 0)
    c_full = tl.minimum(tl.cdiv(tl.maximum(nv_first - BN + LC, 0), NBJ * R), n_ch)
    C_LO: tl.constexpr = (LC - 1 + NBJ * R - 1) // (NBJ * R)   # first chunk whose tokens are all >= 0
    # overlap counts of chunk-relative compressed token r with block j0 + c: [BN, NBJ_PAD]
    r_ = tl.arange(0, BN)[:, None]
    c_ = tl.arange(0, NBJ_PAD)[None, :]
    ov = tl.minimum(r_, c_ * R + R - 1) - tl.maximum(r_ - (LC - 1), c_ * R) + 1
    cnt = tl.where((ov > 0) & (c_ < NBJ), ov, 0).to(tl.float32)
    kc_base = KC + b * skb + h * skh
    scr = SCRATCH + (pid_bh * n_tiles + pid_m).to(tl.int64) * (BT * NBJ_PAD) if RELAY else SCRATCH
    if KEY64:
        run = tl.full([BT, KR], -1, tl.int64)
    else:
        run = tl.full([BT, KR], -1, tl.int32)
    run = _scan(run, q, lse2, tpos, cur, cnt, kc_base, skt, 0, tl.minimum(C_LO, n_ch), N, scale_log2,
                G, GP, L_CMP, STRIDE, R, LC, DK, BDK, BT, BN, NBJ, NBJ_PAD, KR, LOGKR, LOGNB, IB, KEY64,
                MAP, P_PREC, DOT_PREC, True, scr, RELAY)
    run = _scan(run, q, lse2, tpos, cur, cnt, kc_base, skt, C_LO, c_full, N, scale_log2,
                G, GP, L_CMP, STRIDE, R, LC, DK, BDK, BT, BN, NBJ, NBJ_PAD, KR, LOGKR, LOGNB, IB, KEY64,
                MAP, P_PREC, DOT_PREC, False, scr, RELAY)
    run = _scan(run, q, lse2, tpos, cur, cnt, kc_base, skt, tl.maximum(C_LO, c_full), n_ch, N, scale_log2,
                G, GP, L_CMP, STRIDE, R, LC, DK, BDK, BT, BN, NBJ, NBJ_PAD, KR, LOGKR, LOGNB, IB, KEY64,
                MAP, P_PREC, DOT_PREC, True, scr, RELAY)
    store_blocks(run, cur, ttok, BI, b, h, sbb, sbt, sbh, T, NSEL, BT, KR, LOGKR, IB)


# ----------------------------------------------------------------------------------------------
# launcher


def select_blocks(q: torch.Tensor, k_cmp: torch.Tensor, lse_cmp: torch.Tensor, *, l: int, d: int,
                  l_sel: int, n_sel: int, scale: float, tuning: ScoreTuning = EXACT_SCORES,
                  wide_keys: bool | None = None, gluon: bool = False, relayout: bool = False,
                  q_off: int = 0) -> torch.Tensor:
    """q [B,T,HQ,dk], k_cmp [B,N,H,dk] (N may be 0), lse_cmp fp32 [B,T,HQ] (natural log, -inf where no
    compressed token is visible) -> block_idx int64 [B,T,H,n_sel], ascending, -1 padded.

    tuning: the tiles (default: the exact fp32 maps); wide_keys forces int64 (True) or int32 (False, only if the
    block count fits) ranking keys (tests and benchmarks). gluon (the plan's choice, nsa/ops/plan.py): the
    score pass in Gluon (scores_gluon.py: the same blocks), the Triton kernel if it fails to launch. relayout
    (the plan's): rank each chunk's scores from a scratch copy, not the replicated head-sum layout. q_off: query
    row t sits at position t + q_off (k_cmp holds the compressed tokens before q_off + T; the plan keeps such
    calls off the Gluon pass)."""
    B, T, HQ, dk = q.shape
    N, H = k_cmp.shape[1], k_cmp.shape[2]
    if gluon and wide_keys is None:
        from . import scores_gluon as sg
        stored = sg.score_pass(q, k_cmp, lse_cmp, l_sel=l_sel, scale=scale)
        if stored is not None:
            scr, n_tiles, nchmax = stored
            return rank_stored(scr, B, T, H, HQ // H, n_sel, l=l, d=d, l_sel=l_sel, n_tiles=n_tiles,
                               nchmax=nchmax, tile=sg.TILE, nbj=sg.NBJ, nbj_pad=sg.NBJ_PAD, device=q.device)
    G = HQ // H
    GP = next_pow2(G)
    R, LC = l_sel // d, l // d
    nsb = triton.cdiv(T + q_off, l_sel)
    bdk = max(16, next_pow2(dk))
    tile = tuning.tile_for(bdk > 128)
    rows, bn_min, warps, stages = tile.rows, tile.min_keys, tile.warps, tile.stages
    block_r = row_block(GP, rows)
    bn = max(16, bn_min, next_pow2(R + LC - 1))
    nbj = (bn - LC + 1) // R
    kr = next_pow2(max(n_sel, 2))
    nbj_pad = max(16, next_pow2(nbj), kr)
    ib = max(1, (nsb - 1).bit_length())
    key64 = GRID_BITS + ib > 31
    if wide_keys is not None:
        if not wide_keys and key64:
            raise ValueError(f"wide_keys=False needs <= 2**{31 - GRID_BITS} selection blocks, got {nsb}")
        key64 = wide_keys
    bt = block_r // GP
    # the CUDA-core map holds a [BT, BN, NBJ_PAD] product: only for small ones (registers)
    mode = tile.map_small if bt <= 16 and bt * bn * nbj_pad <= 16384 else tile.map_big
    bi = torch.empty(B, T, H, n_sel, device=q.device, dtype=torch.int64)
    n_tiles = triton.cdiv(T, bt)
    # RELAY: one [bt, nbj_pad] fp32 scratch per program (T * H * 64 B at the default tiles)
    scratch = torch.empty(n_tiles * B * H * bt * nbj_pad if relayout else 1, device=q.device,
                          dtype=torch.float32)
    _select_kernel[(n_tiles, B * H)](
        q, k_cmp, lse_cmp.contiguous(), bi, scratch, q.stride(0), q.stride(1), q.stride(2),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), bi.stride(0), bi.stride(1), bi.stride(2),
        T, N, H, n_tiles, q_off, scale * LOG2E, G=G, GP=GP, L_CMP=l, STRIDE=d, LSEL=l_sel, NSEL=n_sel, DK=dk,
        BDK=bdk, BLOCK_R=block_r, BN=bn, NBJ=nbj, NBJ_PAD=nbj_pad, KR=kr, LOGKR=kr.bit_length() - 1,
        LOGNB=nbj_pad.bit_length() - 1, IB=ib, KEY64=key64, MAP=mode,
        P_PREC="tf32x3" if q.is_cuda else "ieee", DOT_PREC=dot_precision(q.dtype, q.is_cuda),
        RELAY=relayout, num_warps=warps, num_stages=stages,
        **reg_cap(tile.max_regs, q.is_cuda))
    return bi


def rank_stored(scr: torch.Tensor, B: int, T: int, H: int, G: int, n_sel: int, *, l: int, d: int, l_sel: int,
                n_tiles: int, nchmax: int, tile: int, nbj: int, nbj_pad: int, device) -> torch.Tensor:
    """block_idx [B,T,H,n_sel] from stored chunk scores (scores_gluon.score_pass): scr [B*H, n_tiles, nchmax,
    tile, nbj_pad] fp32, flat (chunk c of a tile holds blocks c*nbj ... c*nbj + nbj - 1); G query heads per KV head."""
    nsb = triton.cdiv(T, l_sel)
    kr = triton.next_power_of_2(max(n_sel, 2))
    ib = max(1, (nsb - 1).bit_length())
    bi = torch.empty(B, T, H, n_sel, device=device, dtype=torch.int64)
    if B * T * H == 0:
        return bi
    _rank_stored_kernel[(n_tiles, B * H)](
        scr, bi, bi.stride(0), bi.stride(1), bi.stride(2), T, H, n_tiles, nchmax, G=G, L_CMP=l, STRIDE=d, LSEL=l_sel,
        NSEL=n_sel, BT=tile, NBJ=nbj, NBJ_PAD=nbj_pad, KR=kr, LOGKR=kr.bit_length() - 1,
        LOGNB=nbj_pad.bit_length() - 1, IB=ib, KEY64=GRID_BITS + ib > 31, num_warps=1)
    return bi


@triton.jit
def _rank_stored_kernel(SCR, BI, sbb, sbt, sbh, T, H, n_tiles, nchmax, G: tl.constexpr, L_CMP: tl.constexpr,
                        STRIDE: tl.constexpr, LSEL: tl.constexpr, NSEL: tl.constexpr, BT: tl.constexpr,
                        NBJ: tl.constexpr, NBJ_PAD: tl.constexpr, KR: tl.constexpr, LOGKR: tl.constexpr,
                        LOGNB: tl.constexpr, IB: tl.constexpr, KEY64: tl.constexpr):
    """One program per (tile of BT tokens, b*H + h): the stored chunks ranked in chunk order (as the one-pass
    kernel merges them), then the forced blocks placed and the row sorted: scores._select_kernel's tail."""
    pid_m = n_tiles - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    ttok = pid_m * BT + tl.arange(0, BT)
    cur = ttok // LSEL
    t_last = tl.minimum(pid_m * BT + BT - 1, T - 1)
    n_ch = tl.cdiv(tl.maximum(t_last // LSEL - 1, 0), NBJ)      # candidates are blocks <= cur - 2
    scr = SCR + (pid_bh.to(tl.int64) * n_tiles + pid_m) * (nchmax * BT * NBJ_PAD)
    r_ = tl.arange(0, BT)[:, None] * NBJ_PAD + tl.arange(0, NBJ_PAD)[None, :]
    if KEY64:
        run = tl.full([BT, KR], -1, tl.int64)
    else:
        run = tl.full([BT, KR], -1, tl.int32)
    for c in range(0, n_ch):
        s = tl.load(scr + c * (BT * NBJ_PAD) + r_)
        run = _merge_chunk(run, s, c * NBJ, cur, BT, NBJ, NBJ_PAD, KR, LOGKR, LOGNB, IB, KEY64,
                           G, L_CMP, STRIDE, scr, False)
    store_blocks(run, cur, ttok, BI, b, h, sbb, sbt, sbh, T, NSEL, BT, KR, LOGKR, IB)
