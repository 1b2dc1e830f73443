"""Group-centric flash attention with a "strided causal" mask, for the compressed and window branches.

Key ``i`` sits at position ``pos(i) = i * STRIDE + OFFSET`` and is visible to the query at ``t`` iff
``pos(i) <= t`` and (when ``WINDOW > 0``) ``pos(i) > t - WINDOW``. Query row r sits at ``t = r + QOFF``
(the launchers' q_off: 0 for prefill; a context-parallel chunk's first position, less the first window
key's position for the window).
- compressed branch: STRIDE = d, OFFSET = l - 1, WINDOW = 0 (block i visible iff i*d + l - 1 <= t);
- sliding window:    STRIDE = 1, OFFSET = 0,     WINDOW = w;
- plain causal:      STRIDE = 1, OFFSET = 0,     WINDOW = 0.

Rows of a program are (token, head-of-group) pairs: row r -> token ``t0 + r // GP``, head ``h*G + r % GP``
with GP = next_pow2(G); rows with ``r % GP >= G`` are padding. All G query heads of a KV head share one
program, so each K/V tile is loaded once per group, and dK/dV of a KV head are summed over its query
heads inside one program (deterministic, no atomics).

Tensors are [B, T, heads, dim] with unit stride in dim; lse / delta are fp32 [B, T, HQ] (natural log).
"""
from __future__ import annotations

from dataclasses import astuple

import torch
import triton
import triton.language as tl

from ..common import LOG2E
from ..tuning import AttnTuning
from ._utils import dot_precision, next_pow2, row_block


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    """One online-softmax step over a key tile: s [R, N] scores in log2 units (-inf where masked),
    v [N, D]; returns the new running max, sum and unnormalised output (rows with nothing visible
    so far keep m = -inf and contribute 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _key_range(t_first, t_last, N, STRIDE: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr):
    """[lo, hi) of keys visible to at least one token of [t_first, t_last]."""
    hi = tl.where(t_last >= OFFSET, (t_last - OFFSET) // STRIDE + 1, 0)
    hi = tl.minimum(hi, N)
    lo = 0
    if WINDOW > 0:
        x = tl.maximum(t_first - WINDOW + 1 - OFFSET, 0)
        lo = (x + STRIDE - 1) // STRIDE
    return lo, hi


@triton.jit
def _visible(pos, tok, STRIDE: tl.constexpr, WINDOW: tl.constexpr):
    """pos [1, BN] or [BN, 1], tok broadcastable -> bool visibility."""
    vis = pos <= tok
    if WINDOW > 0:
        vis = vis & (pos > tok - WINDOW)
    return vis


@triton.jit
def token_rows(pid_m, pid_bh, T, H, G: tl.constexpr, GP: tl.constexpr, BLOCK_R: tl.constexpr):
    """The rows of a (tile pid_m of BLOCK_R // GP tokens, b * H + h) program: row r is query head h*G + r % GP
    of token pid_m * BT + r // GP. Returns (b int64, h, tok [R], row_ok [R], hq [R] int64, tok64 [R])."""
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    rows = tl.arange(0, BLOCK_R)
    tok = pid_m * (BLOCK_R // GP) + rows // GP
    g = rows % GP
    row_ok = (tok < T) & (g < G)
    hq = (h * G + g).to(tl.int64)
    return b, h, tok, row_ok, hq, tok.to(tl.int64)


@triton.jit
def load_group(X, b, t64, hq, row_ok, offs, sxb, sxt, sxh, D: tl.constexpr):
    """X rows [R, len(offs)] of batch b at token(s) t64 (a scalar, or [R, 1]) and query heads hq [R]."""
    return tl.load(X + b * sxb + t64 * sxt + hq[:, None] * sxh + offs[None, :],
                   mask=row_ok[:, None] & (offs[None, :] < D), other=0.0)


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE,
                     sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
                     T, N, H, QOFF, scale_log2,
                     G: tl.constexpr, GP: tl.constexpr, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
                     WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    BT: tl.constexpr = BLOCK_R // GP  # tokens per program
    pid_m = tl.program_id(0)
    b, h, tok, row_ok, hq, tok64 = token_rows(pid_m, tl.program_id(1), T, H, G, GP, BLOCK_R)   # [R]
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = load_group(Q, b, tok64[:, None], hq, row_ok, offs_dk, sqb, sqt, sqh, DK)  # [R, BDK]
    t_first = QOFF + pid_m * BT                         # query positions: row token + QOFF
    t_last = QOFF + tl.minimum(pid_m * BT + BT - 1, T - 1)
    lo, hi = _key_range(t_first, t_last, N, STRIDE, OFFSET, WINDOW)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BDV], tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    for start in range(lo, hi, BLOCK_N):
        ki = start + tl.arange(0, BLOCK_N)              # [BN]
        k_ok = ki < hi
        ki64 = ki.to(tl.int64)
        k = tl.load(k_base + ki64[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)  # [BN, BDK]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2          # [R, BN], log2 units
        vis = _visible((ki * STRIDE + OFFSET)[None, :], tok[:, None] + QOFF, STRIDE, WINDOW) & k_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        v = tl.load(v_base + ki64[:, None] * svt + offs_dv[None, :],
                    mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)  # [BN, BDV]
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]          # exactly 0 when nothing is visible
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(O + b * sob + tok64[:, None] * sot + hq[:, None] * soh + offs_dv[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    # lse / delta / gates are contiguous [B, T, HQ]
    tl.store(LSE + (b * T + tok64) * (H * G) + hq, lse, mask=row_ok)


@triton.jit
def _load_rows_bwd(Q, DO, LSE, DELTA, GATE, b, tok64, hq, row_ok, offs_dk, offs_dv,
                   sqb, sqt, sqh, sdb, sdt, sdh, T, HQ, sgt,
                   DK: tl.constexpr, DV: tl.constexpr, HAS_GATE: tl.constexpr):
    """q [R, BDK], do [R, BDV], lse in log2 units, delta, and the rows' gates (1 without): the branch's
    dO is gate * do, applied to p by the callers (dS = g p (dP - delta), dV += (g p)^T do), so no
    converted dO tile is held."""
    q = load_group(Q, b, tok64[:, None], hq, row_ok, offs_dk, sqb, sqt, sqh, DK)
    do = load_group(DO, b, tok64[:, None], hq, row_ok, offs_dv, sdb, sdt, sdh, DV)
    ridx = (b * T + tok64) * HQ + hq
    lse = tl.load(LSE + ridx, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + ridx, mask=row_ok, other=0.0)
    if HAS_GATE:
        gate = tl.load(GATE + ridx * sgt, mask=row_ok, other=0.0).to(tl.float32)
    else:
        gate = tl.full([q.shape[0]], 1.0, tl.float32)
    return q, do, lse, delta, gate


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, GATE, DQ, DQ_IN,
                        sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, sgt,
                        T, N, H, QOFF, scale_log2, scale,
                        G: tl.constexpr, GP: tl.constexpr, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
                        WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                        HAS_GATE: tl.constexpr, ACC_DQ: tl.constexpr, DOT_PREC: tl.constexpr):
    BT: tl.constexpr = BLOCK_R // GP
    pid_m = tl.program_id(0)
    b, h, tok, row_ok, hq, tok64 = token_rows(pid_m, tl.program_id(1), T, H, G, GP, BLOCK_R)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q, do, lse, delta, gate = _load_rows_bwd(Q, DO, LSE, DELTA, GATE, b, tok64, hq, row_ok, offs_dk,
                                             offs_dv, sqb, sqt, sqh, sdb, sdt, sdh, T, H * G, sgt, DK, DV,
                                             HAS_GATE)
    t_first = QOFF + pid_m * BT                         # query positions: row token + QOFF
    t_last = QOFF + tl.minimum(pid_m * BT + BT - 1, T - 1)
    lo, hi = _key_range(t_first, t_last, N, STRIDE, OFFSET, WINDOW)
    dq = tl.zeros([BLOCK_R, BDK], tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    for start in range(lo, hi, BLOCK_N):
        ki = start + tl.arange(0, BLOCK_N)
        k_ok = ki < hi
        ki64 = ki.to(tl.int64)
        k = tl.load(k_base + ki64[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(v_base + ki64[:, None] * svt + offs_dv[None, :],
                    mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        vis = _visible((ki * STRIDE + OFFSET)[None, :], tok[:, None] + QOFF, STRIDE, WINDOW) & k_ok[None, :]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0) * gate[:, None]   # [R, BN], g p
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)                          # [R, BN]
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    dq = dq * scale
    # dq buffers are contiguous [B, T, HQ, DK]; ACC_DQ adds the previous branches' fp32 dq
    dq_off = ((b * T + tok64) * (H * G) + hq)[:, None] * DK + offs_dk[None, :]
    dq_mask = row_ok[:, None] & (offs_dk[None, :] < DK)
    if ACC_DQ:
        dq += tl.load(DQ_IN + dq_off, mask=dq_mask, other=0.0)
    tl.store(DQ + dq_off, dq.to(DQ.dtype.element_ty), mask=dq_mask)


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, GATE, DK_, DV_,
                          sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, sgt,
                          T, N, H, B, TPS, QOFF, scale_log2, scale,
                          G: tl.constexpr, GP: tl.constexpr, STRIDE: tl.constexpr, OFFSET: tl.constexpr,
                          WINDOW: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                          BDK: tl.constexpr, BDV: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr, HAS_GATE: tl.constexpr, DOT_PREC: tl.constexpr,
                          SPLIT: tl.constexpr):
    """One program per (key tile, b, kv head, query split); loops over the query-row tiles that can
    see the key tile. SPLIT: split s only visits row tiles [s*TPS, (s+1)*TPS) and writes fp32
    partials to DK_/DV_ laid out [n_split, B, N, H, d] (summed in a fixed order by the launcher), so
    the long query range of early compressed keys is spread over many programs."""
    BT: tl.constexpr = BLOCK_R // GP
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    ki = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ki < N
    ki64 = ki.to(tl.int64)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    k = tl.load(K + b * skb + h * skh + ki64[:, None] * skt + offs_dk[None, :],
                mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)   # [BN, BDK]
    v = tl.load(V + b * svb + h * svh + ki64[:, None] * svt + offs_dv[None, :],
                mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)   # [BN, BDV]
    pos = ki * STRIDE + OFFSET - QOFF                                      # [BN], in query rows
    t_lo = tl.maximum(pid_n * BLOCK_N * STRIDE + OFFSET - QOFF, 0)
    n_last = tl.minimum(pid_n * BLOCK_N + BLOCK_N, N) - 1
    t_hi = T - 1
    if WINDOW > 0:   # may be < 0 (keys before the window of every query): no row tile
        t_hi = tl.minimum(n_last * STRIDE + OFFSET - QOFF + WINDOW - 1, T - 1)
    dk = tl.zeros([BLOCK_N, BDK], tl.float32)
    dv = tl.zeros([BLOCK_N, BDV], tl.float32)
    rows = tl.arange(0, BLOCK_R)
    g = rows % GP
    hq = (h * G + g).to(tl.int64)
    m_lo = t_lo // BT
    m_hi = (tl.maximum(t_hi, -1) + BT) // BT
    if SPLIT:
        pid_s = tl.program_id(2)
        m_lo = tl.maximum(m_lo, pid_s * TPS)
        m_hi = tl.minimum(m_hi, pid_s * TPS + TPS)
    for m in range(m_lo, m_hi):
        tok = m * BT + rows // GP
        row_ok = (tok < T) & (g < G)
        tok64 = tok.to(tl.int64)
        q, do, lse, delta, gate = _load_rows_bwd(Q, DO, LSE, DELTA, GATE, b, tok64, hq, row_ok, offs_dk,
                                                 offs_dv, sqb, sqt, sqh, sdb, sdt, sdh, T, H * G, sgt,
                                                 DK, DV, HAS_GATE)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * scale_log2                          # [BN, R]
        vis = _visible(pos[:, None], tok[None, :], STRIDE, WINDOW) & row_ok[None, :] & k_ok[:, None]
        pT = tl.where(vis, tl.exp2(sT - lse[None, :]), 0.0) * gate[None, :]                        # g p
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)                                      # [BN, R]
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=DOT_PREC)
    dk = dk * scale
    if SPLIT:
        row = ((tl.program_id(2) * B + b) * N + ki64) * H + h              # [BN] rows of the partials
        tl.store(DK_ + row[:, None] * DK + offs_dk[None, :], dk, mask=k_ok[:, None] & (offs_dk[None, :] < DK))
        tl.store(DV_ + row[:, None] * DV + offs_dv[None, :], dv, mask=k_ok[:, None] & (offs_dv[None, :] < DV))
    else:
        tl.store(DK_ + b * skb + h * skh + ki64[:, None] * skt + offs_dk[None, :],
                 dk.to(DK_.dtype.element_ty), mask=k_ok[:, None] & (offs_dk[None, :] < DK))
        tl.store(DV_ + b * svb + h * svh + ki64[:, None] * svt + offs_dv[None, :],
                 dv.to(DV_.dtype.element_ty), mask=k_ok[:, None] & (offs_dv[None, :] < DV))


# ----------------------------------------------------------------------------------------------
# launchers


def _geometry(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    B, T, HQ, dk = q.shape
    N, H = k.shape[1], k.shape[2]
    dv = v.shape[3]
    G = HQ // H
    return B, T, HQ, dk, N, H, dv, G


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: small, so that the tests exercise the split path


def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, stride: int, offset: int,
             window: int, scale: float, tuning: AttnTuning | None = None,
             q_off: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,HQ,dk], k [B,N,H,dk], v [B,N,H,dv] (unit stride in dim) -> (o [B,T,HQ,dv], lse fp32 [B,T,HQ]).
    tuning: the tiles (None: the preset of q's device). q_off: query row t sits at position t + q_off
    (the keys' positions stay i * stride + offset)."""
    tuning = tuning or AttnTuning()
    B, T, HQ, dk, N, H, dv, G = _geometry(q, k, v)
    o = torch.empty(B, T, HQ, dv, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    GP = next_pow2(G)
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    big = max(bdk, bdv) > 128
    br, block_n, warps, stages = astuple(tuning.tiles(big)[0])
    block_r = row_block(GP, br)
    grid = (triton.cdiv(T, block_r // GP), B * H)
    _attn_fwd_kernel[grid](
        q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, N, H, q_off, scale * LOG2E, G=G, GP=GP, STRIDE=stride, OFFSET=offset, WINDOW=window, DK=dk, DV=dv,
        BDK=bdk, BDV=bdv, BLOCK_R=block_r, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype, q.is_cuda),
        num_warps=warps, num_stages=stages)
    return o, lse


def attn_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, gate: torch.Tensor | None, *, stride: int, offset: int, window: int,
             scale: float, dq_in: torch.Tensor | None = None,
             dq_dtype: torch.dtype | None = None,
             tuning: AttnTuning | None = None, q_off: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of attn_fwd. do [B,T,HQ,dv] (unit stride in dim); delta fp32 [B,T,HQ] = rowsum(dO*O)
    with dO the branch's own output gradient; gate: optional [B,T,HQ] view (any last stride) scaling
    do per row (dO_branch = gate * do), in which case delta must be rowsum(do*O) and is scaled too.
    dq_in: optional contiguous fp32 [B,T,HQ,dk] added to dq (accumulation across branches).
    tuning: the tiles (None: the preset of q's device). q_off: as in attn_fwd.
    Returns (dq contiguous in dq_dtype (default q's), dk, dv in k's/v's dtypes)."""
    # dK/dV are written with k's/v's strides, so k/v must be dense (a strided view of a larger
    # buffer would make torch.empty_like allocate a different layout and the kernel write out of bounds)
    k, v = k.contiguous(), v.contiguous()
    B, T, HQ, dk, N, H, dv, G = _geometry(q, k, v)
    dq_dtype = dq_dtype or q.dtype
    # in place when accumulating in fp32: each element is read and written by the same program
    dq = dq_in if dq_in is not None and dq_dtype == torch.float32 else \
        torch.empty(B, T, HQ, dk, device=q.device, dtype=dq_dtype)
    GP = next_pow2(G)
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    _, dq_tile, dkdv_tile = (tuning or AttnTuning()).tiles(max(bdk, bdv) > 128)
    has_gate = gate is not None
    g_arg = gate if has_gate else lse
    sgt = gate.stride(2) if has_gate else 1
    if has_gate:
        # (a batch of one may be a slice of a longer sequence: its batch stride is never read)
        assert gate.stride(1) == HQ * sgt and (B == 1 or gate.stride(0) == T * HQ * sgt), \
            "gate must be a [B,T,HQ,c] slice"
    lse = lse.contiguous()
    delta = delta.contiguous()
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), sgt)
    meta = dict(G=G, GP=GP, STRIDE=stride, OFFSET=offset, WINDOW=window, DK=dk, DV=dv, BDK=bdk, BDV=bdv,
                HAS_GATE=has_gate, DOT_PREC=dot_precision(q.dtype, q.is_cuda))
    br, bn, warps, stages = astuple(dq_tile)
    block_r = row_block(GP, br)
    _attn_bwd_dq_kernel[(triton.cdiv(T, block_r // GP), B * H)](
        q, k, v, do, lse, delta, g_arg, dq, dq if dq_in is None else dq_in, *strides,
        T, N, H, q_off, scale * LOG2E, scale, BLOCK_R=block_r, BLOCK_N=bn, ACC_DQ=dq_in is not None,
        num_warps=warps, num_stages=stages, **meta)
    dkk, dvv = torch.empty_like(k), torch.empty_like(v)
    if N == 0:
        return dq, dkk, dvv
    br, block_n, warps, stages = astuple(dkdv_tile)
    block_r = row_block(GP, br)
    n_tiles = triton.cdiv(N, block_n)
    row_tiles = triton.cdiv(T, block_r // GP)
    n_split = 1
    if window == 0:  # early keys are seen by (almost) every query: split the query range
        n_split = max(1, min(32, row_tiles, triton.cdiv(8 * _num_sms(q.device), n_tiles * B * H)))
    tps = triton.cdiv(row_tiles, n_split)
    n_split = triton.cdiv(row_tiles, tps)
    if n_split > 1:
        pk = torch.empty(n_split, B, N, H, dk, device=q.device, dtype=torch.float32)
        pv = torch.empty(n_split, B, N, H, dv, device=q.device, dtype=torch.float32)
    else:
        pk, pv = dkk, dvv
    _attn_bwd_dkdv_kernel[(n_tiles, B * H, n_split)](
        q, k, v, do, lse, delta, g_arg, pk, pv, *strides, T, N, H, B, tps, q_off, scale * LOG2E, scale,
        BLOCK_R=block_r, BLOCK_N=block_n, SPLIT=n_split > 1, num_warps=warps, num_stages=stages, **meta)
    if n_split > 1:  # fixed-order reduction over the splits (deterministic)
        dkk.copy_(pk.sum(0))
        dvv.copy_(pv.sum(0))
    return dq, dkk, dvv
