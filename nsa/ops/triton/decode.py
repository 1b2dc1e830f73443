"""NSA decode on Triton: a few query tokens per sequence (usually one) against the KV cache.

Four launches, every grid sized from buffer capacities (never from the current length), and the
query position read from a device tensor when one is given, so one CUDA graph replays every step:

1. ``_cmp_kernel``      grid (NCH, R*H)  [R = B*Tq query rows, H kv heads]
   Split-K over the compressed tokens (flash-decoding): program c walks its chunk of SUBS sub-tiles
   of CCS compressed tokens. Per sub-tile it keeps the unnormalised p = exp2(x - m_sub) for the G
   heads of the group and maps it to the NBJ selection blocks the sub-tile owns with the overlap
   counts (a (r-1)-token halo before the sub-tile makes every block's score local to one sub-tile):
   sp[g, j] and m_sub[g] go to scratch. It also accumulates the chunk's softmax partial (m, l, o)
   over its own tokens.
2. ``_topn_kernel``     grid (R*H,)
   lse_g from the chunk partials, scores s[j] = sum_g exp2(m_sub[g] - lse_g) * sp[g, j], then the
   top-n of nsa.ops.common (score grid 2**-20 of the normalised score, forced blocks by priority,
   ties to the lower index) as one int64 key per block; writes block_idx ascending, -1 padded.
3. ``_slc_win_kernel``  grid (NSS + NWC, R*H): selected-block attention (SPB selected blocks a
   program) and the sliding window (BW tokens a program), softmax partials.
4. ``_combine_kernel``  grid (R*HQ,): merges the partials of the three branches and the gates.

Shapes: q [B,Tq,HQ,dk], k_cmp/v_cmp [B,Ncap,H,*], k_slc/v_slc [B,Scap,H,*], k_win/v_win [B,Swcap,H,*],
gates [B,Tq,HQ,3]; any strides with a unit last dim. Forward only (decode is inference).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._utils import dot_precision, next_pow2

LOG2E = 1.4426950408889634
SCORE_BITS = 20          # must equal nsa.ops.common.SCORE_BITS (asserted by the tests)
FORCED_STEP = 2 ** (SCORE_BITS + 1)
WIN_TILE = 64            # BW: window tokens per window program
# Launch knobs, measured by bench/bench_decode.py --sweep (H200, HQ=64, H=4, d=128, bf16, 64k):
# cmp_tile = compressed tokens loaded per sub-tile (own tokens + the halo); per_sm = split-K target
# in programs per multiprocessor; warps/stages of the cmp and slc/win kernels (G >= 16, d >= 128).
TUNE = dict(cmp_tile=64, per_sm=4, cmp_warps=4, cmp_stages=3, slc_warps=8, slc_stages=2, topn_warps=16)
LAST_LAUNCH: dict = {}   # the compiled kernels of the last call (register / spill diagnostics)
_SUPPORTED = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@triton.jit(do_not_specialize=["pos_base"])
def _cmp_kernel(Q, KC, VC, POS, SP, MS, CM, CL, CO, sqb, sqt, sqh, skcb, skct, skch, svcb, svct, svch,
                spos, pos_base, Tq, H, NBUF, NCH, NSUB, NBCAP, SUBS, scale_log2,
                G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BDK: tl.constexpr, BDV: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr,
                LSEL: tl.constexpr, BN: tl.constexpr, NBJ: tl.constexpr, NBJ_PAD: tl.constexpr,
                POS_PTR: tl.constexpr, DOT_PREC: tl.constexpr, P_PREC: tl.constexpr):
    """Split-K compressed attention + per-head block-score partials of chunk pid (see module doc)."""
    R: tl.constexpr = LSEL // STRIDE          # stride chunks per selection block (u)
    LC: tl.constexpr = L_CMP // STRIDE        # stride chunks per compression block (r)
    CCS: tl.constexpr = NBJ * R               # own compressed tokens per sub-tile
    pid = tl.program_id(0)
    rh = tl.program_id(1)
    row = rh // H
    h = rh % H
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    if POS_PTR:   # device-side position (CUDA-graph replay) or a host int
        t = tl.load(POS + b * spos).to(tl.int64) + iq
    else:
        t = pos_base.to(tl.int64) + iq
    g = tl.arange(0, GP)
    g_ok = g < G
    hq = (h * G + g).to(tl.int64)
    HQ = H * G
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + iq * sqt + hq[:, None] * sqh + offs_dk[None, :],
                mask=g_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)          # [GP, BDK]
    n_vis = tl.minimum(tl.where(t + 1 >= L_CMP, (t + 1 - L_CMP) // STRIDE + 1, 0), NBUF)
    # sub-tiles holding a visible token (their load window starts r-1 tokens early)
    st_end = tl.where(n_vis > 0, (n_vis + LC - 1 + CCS - 1) // CCS, 0)
    st_lo = pid * SUBS
    st_hi = tl.minimum(st_lo + SUBS, st_end).to(tl.int32)
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BDV], tl.float32)
    kc_base = KC + b * skcb + h * skch
    vc_base = VC + b * svcb + h * svch
    jcol = tl.arange(0, NBJ_PAD)
    sp_row = (row * HQ + hq).to(tl.int64)[:, None] * NBCAP
    for st in range(st_lo, st_hi):
        i0 = st * CCS
        ki = i0 - (LC - 1) + tl.arange(0, BN)                                   # [BN] with the halo
        k_ok = (ki >= 0) & (ki < n_vis)
        own = k_ok & (ki >= i0) & (ki < i0 + CCS)
        ki64 = ki.to(tl.int64)
        k = tl.load(kc_base + ki64[:, None] * skct + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(vc_base + ki64[:, None] * svct + offs_dv[None, :],
                    mask=own[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2        # [GP, BN]
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_s = tl.max(s, 1)                                                      # finite: a token is visible
        p = tl.exp2(s - m_s[:, None])
        # block scores of the NBJ blocks this sub-tile owns: sp = p @ cnt (overlap in stride chunks)
        jj = st * NBJ + jcol
        lo = tl.maximum(ki[:, None], (jj * R)[None, :])
        hi = tl.minimum(ki[:, None] + LC - 1, (jj * R + R - 1)[None, :])
        cnt = tl.where((hi >= lo) & (jcol < NBJ)[None, :], hi - lo + 1, 0).to(tl.float32)
        sp = tl.dot(p, cnt, input_precision=P_PREC)                             # [GP, NBJ_PAD]
        tl.store(SP + sp_row + jj[None, :], sp, mask=g_ok[:, None] & (jcol < NBJ)[None, :])
        tl.store(MS + (rh.to(tl.int64) * NSUB + st) * GP + g, m_s)
        # online softmax over the sub-tile's own tokens
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        p_own = tl.where(own[None, :], p * tl.exp2(m_s - m_new)[:, None], 0.0)
        l_run = l_run * alpha + tl.sum(p_own, 1)
        acc = acc * alpha[:, None] + tl.dot(p_own.to(v.dtype), v, input_precision=DOT_PREC)
        m_run = m_new
    part = (row * NCH + pid).to(tl.int64) * HQ + hq                             # [GP] rows of [R, NCH, HQ]
    wr = g_ok & ((tl.zeros([GP], tl.int64) + st_lo) < st_end)                   # vector mask (interpreter)
    tl.store(CM + part, m_run, mask=wr)
    tl.store(CL + part, l_run, mask=wr)
    tl.store(CO + part[:, None] * DV + offs_dv[None, :], acc, mask=wr[:, None] & (offs_dv[None, :] < DV))


@triton.jit(do_not_specialize=["pos_base"])
def _topn_kernel(POS, SP, MS, CM, CL, BI, spos, pos_base, sbb, sbt, sbh,
                 Tq, H, NBUF, NCH, NSUB, NBCAP, SUBS,
                 G: tl.constexpr, GP: tl.constexpr, GC: tl.constexpr, L_CMP: tl.constexpr,
                 STRIDE: tl.constexpr, LSEL: tl.constexpr, NBJ: tl.constexpr, NSEL: tl.constexpr,
                 NSEL_P2: tl.constexpr, NB_P2: tl.constexpr, NCH_P2: tl.constexpr, FSTEP: tl.constexpr,
                 POS_PTR: tl.constexpr):
    """Group scores from the per-head partials, then the deterministic top-n (one (row, kv head))."""
    R: tl.constexpr = LSEL // STRIDE
    LC: tl.constexpr = L_CMP // STRIDE
    CCS: tl.constexpr = NBJ * R
    rh = tl.program_id(0)
    row = rh // H
    h = rh % H
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    if POS_PTR:
        t = tl.load(POS + b * spos).to(tl.int64) + iq
    else:
        t = pos_base.to(tl.int64) + iq
    n_vis = tl.minimum(tl.where(t + 1 >= L_CMP, (t + 1 - L_CMP) // STRIDE + 1, 0), NBUF)
    st_end = tl.where(n_vis > 0, (n_vis + LC - 1 + CCS - 1) // CCS, 0)
    nch_used = (st_end + SUBS - 1) // SUBS
    cur = t // LSEL                                        # block of t; eligible blocks are 0..cur
    j = tl.arange(0, NB_P2)
    # block j has a visible compressed token (vector form of n_vis > 0: see the interpreter note)
    vis = (j * R - (LC - 1) < n_vis) & (j <= cur) & ((tl.zeros([NB_P2], tl.int64) + n_vis) > 0)
    st = (j // NBJ).to(tl.int64)
    c = tl.arange(0, NCH_P2)
    HQ = H * G
    s = tl.zeros([NB_P2], tl.float32)
    for g0 in range(0, G, GC):                             # GC heads at a time: loads in flight together
        g = g0 + tl.arange(0, GC)
        g_ok = g < G
        hq = (h * G + g).to(tl.int64)
        cmask = (c < nch_used)[:, None] & g_ok[None, :]
        coff = (row * NCH + c).to(tl.int64)[:, None] * HQ + hq[None, :]         # [NCH_P2, GC]
        cm = tl.load(CM + coff, mask=cmask, other=float("-inf"))
        cl = tl.load(CL + coff, mask=cmask, other=0.0)
        mx = tl.max(cm, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        lse = mx + tl.log2(tl.maximum(tl.sum(tl.exp2(cm - mx[None, :]) * cl, 0), 1e-30))   # [GC]
        jmask = g_ok[:, None] & vis[None, :]
        ms = tl.load(MS + (rh.to(tl.int64) * NSUB + st)[None, :] * GP + g[:, None], mask=jmask, other=0.0)
        sp = tl.load(SP + (row * HQ + hq)[:, None] * NBCAP + j[None, :], mask=jmask, other=0.0)
        s += tl.sum(tl.where(jmask, tl.exp2(ms - lse[:, None]) * sp, 0.0), 0)
    # comparison grid of nsa.ops.common: round-half-even(s * 2**20 * d / (G*l)) in fp64
    mult = tl.full([NB_P2], 1048576.0 * STRIDE, tl.float64) / (G * L_CMP)
    x = s.to(tl.float64) * mult
    grid = ((x + 4503599627370496.0) - 4503599627370496.0).to(tl.int64)   # rint for 0 <= x < 2**52
    prio = tl.where(j == cur, 3, tl.where(j == 0, 2, tl.where(j == cur - 1, 1, 0))).to(tl.int64)
    # one unique int64 key: priority, then grid score, then the lower index
    key = tl.where(j <= cur, (prio * FSTEP + grid) * NB_P2 + (NB_P2 - 1 - j), -1)
    sel = tl.zeros([NB_P2], tl.int32)
    for _ in range(NSEL):
        m = tl.max(key, 0)
        hit = (key == m) & (key >= 0)
        sel = tl.where(hit, 1, sel)
        key = tl.where(hit, -1, key)
    slot = tl.cumsum(sel, 0) - 1
    out = BI + b * sbb + iq.to(tl.int64) * sbt + h * sbh
    tl.store(out + slot, j.to(tl.int64), mask=sel > 0)
    n_chosen = tl.sum(sel, 0)
    k = tl.arange(0, NSEL_P2)
    tl.store(out + k, tl.full([NSEL_P2], -1, tl.int64), mask=(k >= n_chosen) & (k < NSEL))


@triton.jit(do_not_specialize=["pos_base", "win_base"])
def _slc_win_kernel(Q, KS, VS, KW, VW, POS, WIN0, BI, SM, SL, SO, WM, WL, WO,
                    sqb, sqt, sqh, sksb, skst, sksh, svsb, svst, svsh, skwb, skwt, skwh, svwb, svwt, svwh,
                    spos, swin, pos_base, win_base, sbb, sbt, sbh, Tq, H, NSS, NWC, scale_log2,
                    G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BDK: tl.constexpr, BDV: tl.constexpr, LSEL: tl.constexpr, NSEL: tl.constexpr,
                    SPB: tl.constexpr, SPB_P2: tl.constexpr, BS: tl.constexpr, W: tl.constexpr,
                    BW: tl.constexpr, POS_PTR: tl.constexpr, DOT_PREC: tl.constexpr):
    """pid < NSS: selected-block attention over SPB selected blocks; else window chunk pid - NSS."""
    pid = tl.program_id(0)
    rh = tl.program_id(1)
    row = rh // H
    h = rh % H
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    if POS_PTR:
        t = tl.load(POS + b * spos).to(tl.int64) + iq
        w0 = tl.load(WIN0 + b * swin).to(tl.int64)             # absolute position of window row 0
    else:
        t = pos_base.to(tl.int64) + iq
        w0 = win_base.to(tl.int64)
    g = tl.arange(0, GP)
    g_ok = g < G
    hq = (h * G + g).to(tl.int64)
    HQ = H * G
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = tl.load(Q + b * sqb + iq * sqt + hq[:, None] * sqh + offs_dk[None, :],
                mask=g_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BDV], tl.float32)
    if pid < NSS:
        ks_base = KS + b * sksb + h * sksh
        vs_base = VS + b * svsb + h * svsh
        slots = pid * SPB + tl.arange(0, SPB_P2)
        js = tl.load(BI + b * sbb + iq.to(tl.int64) * sbt + h * sbh + slots,
                     mask=(slots < NSEL) & (tl.arange(0, SPB_P2) < SPB), other=-1)  # all ids at once
        for i in range(SPB):
            j = tl.sum(tl.where(tl.arange(0, SPB_P2) == i, js, 0), 0)
            for sub in tl.static_range(0, LSEL, BS):
                kk = sub + tl.arange(0, BS)
                kp = j * LSEL + kk
                ok = (kp >= 0) & (kk < LSEL) & (kp <= t)     # j = -1 (unused slot) gives kp < 0
                k = tl.load(ks_base + kp[:, None] * skst + offs_dk[None, :],
                            mask=ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
                v = tl.load(vs_base + kp[:, None] * svst + offs_dv[None, :],
                            mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
                s = tl.where(ok[None, :], s, float("-inf"))
                m_new = tl.maximum(m_run, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_run - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_run = l_run * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
                m_run = m_new
        part = (row * NSS + pid).to(tl.int64) * HQ + hq
        tl.store(SM + part, m_run, mask=g_ok)
        tl.store(SL + part, l_run, mask=g_ok)
        tl.store(SO + part[:, None] * DV + offs_dv[None, :], acc,
                 mask=g_ok[:, None] & (offs_dv[None, :] < DV))
    else:
        c = pid - NSS
        lo_w = tl.maximum(t - W + 1, 0)
        kp = lo_w + c * BW + tl.arange(0, BW)                                   # absolute positions
        ok = kp <= t
        kr = kp - w0                                                            # rows of the window buffer
        k = tl.load(KW + b * skwb + h * skwh + kr[:, None] * skwt + offs_dk[None, :],
                    mask=ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(VW + b * svwb + h * svwh + kr[:, None] * svwt + offs_dv[None, :],
                    mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        s = tl.where(ok[None, :], s, float("-inf"))
        m = tl.max(s, 1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp2(s - m_safe[:, None])
        o = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        part = (row * NWC + c).to(tl.int64) * HQ + hq
        wr = g_ok & ((tl.zeros([GP], tl.int64) + lo_w + c * BW) <= t)
        tl.store(WM + part, m, mask=wr)
        tl.store(WL + part, tl.sum(p, 1), mask=wr)
        tl.store(WO + part[:, None] * DV + offs_dv[None, :], o, mask=wr[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _merge(M, L, O, base, n, offs_dv, DV: tl.constexpr, NP: tl.constexpr, HQ):
    """Softmax-merge partials [n] at rows base + c*HQ of M/L [.., HQ] and O [.., HQ, DV] -> [BDV]."""
    c = tl.arange(0, NP)
    ok = c < n
    rows = base + c.to(tl.int64) * HQ
    m = tl.load(M + rows, mask=ok, other=float("-inf"))
    lsum = tl.load(L + rows, mask=ok, other=0.0)
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wt = tl.where(ok, tl.exp2(m - mx), 0.0)
    o = tl.load(O + rows[:, None] * DV + offs_dv[None, :], mask=ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0)
    tot = tl.sum(wt * lsum, 0)
    return tl.sum(wt[:, None] * o, 0), tot, mx


@triton.jit(do_not_specialize=["pos_base"])
def _combine_kernel(POS, GT, O, CM, CL, CO, WM, WL, WO, SM, SL, SO, spos, pos_base,
                    sgb, sgt, sgh, sgk, sob, sot, soh, Tq, H, NBUF, NCH, NSS, SUBS,
                    G: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, L_CMP: tl.constexpr,
                    STRIDE: tl.constexpr, LSEL: tl.constexpr, W: tl.constexpr, NBJ: tl.constexpr,
                    NWC: tl.constexpr, NWC_P2: tl.constexpr, NSS_P2: tl.constexpr, BW: tl.constexpr,
                    CB: tl.constexpr, POS_PTR: tl.constexpr):
    R: tl.constexpr = LSEL // STRIDE
    LC: tl.constexpr = L_CMP // STRIDE
    CCS: tl.constexpr = NBJ * R
    pid = tl.program_id(0)
    HQ = H * G
    row = pid // HQ
    hq = pid % HQ
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    if POS_PTR:
        t = tl.load(POS + b * spos).to(tl.int64) + iq
    else:
        t = pos_base.to(tl.int64) + iq
    offs_dv = tl.arange(0, BDV)
    # compressed branch: partials of the chunks that saw a visible token, CB chunks at a time
    n_vis = tl.minimum(tl.where(t + 1 >= L_CMP, (t + 1 - L_CMP) // STRIDE + 1, 0), NBUF)
    st_end = tl.where(n_vis > 0, (n_vis + LC - 1 + CCS - 1) // CCS, 0)
    nch_used = ((st_end + SUBS - 1) // SUBS).to(tl.int32)
    m_c = tl.full([], float("-inf"), tl.float32)
    l_c = tl.zeros([], tl.float32)
    o_c = tl.zeros([BDV], tl.float32)
    for c0 in range(0, nch_used, CB):
        o_p, l_p, m_p = _merge(CM, CL, CO, (row * NCH + c0).to(tl.int64) * HQ + hq, nch_used - c0,
                               offs_dv, DV, CB, HQ)
        m_new = tl.maximum(m_c, m_p)
        a_old = tl.exp2(m_c - m_new)
        a_new = tl.exp2(m_p - m_new)
        o_c = o_c * a_old + o_p * a_new
        l_c = l_c * a_old + l_p * a_new
        m_c = m_new
    o_cmp = tl.where(l_c > 0, o_c / tl.maximum(l_c, 1e-30), 0.0)                # exactly 0 when empty
    lo_w = tl.maximum(t - W + 1, 0)
    nwc_used = (t - lo_w + BW) // BW
    o_w, l_w, _m = _merge(WM, WL, WO, (row * NWC).to(tl.int64) * HQ + hq, nwc_used, offs_dv, DV, NWC_P2, HQ)
    o_s, l_s, _m = _merge(SM, SL, SO, (row * NSS).to(tl.int64) * HQ + hq, NSS, offs_dv, DV, NSS_P2, HQ)
    gp = GT + b * sgb + iq.to(tl.int64) * sgt + hq.to(tl.int64) * sgh
    g0 = tl.load(gp).to(tl.float32)
    g1 = tl.load(gp + sgk).to(tl.float32)
    g2 = tl.load(gp + 2 * sgk).to(tl.float32)
    o = g0 * o_cmp + g1 * (o_s / tl.maximum(l_s, 1e-30)) + g2 * (o_w / tl.maximum(l_w, 1e-30))
    tl.store(O + b * sob + iq.to(tl.int64) * sot + hq.to(tl.int64) * soh + offs_dv, o.to(O.dtype.element_ty),
             mask=offs_dv < DV)


# ----------------------------------------------------------------------------------------------
# launcher


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check(q: torch.Tensor, v: torch.Tensor, gates: torch.Tensor) -> None:
    """NotImplementedError (the dispatcher falls back to torch) for what the kernels do not cover."""
    if q.dtype not in _SUPPORTED or gates.dtype not in _SUPPORTED:
        raise NotImplementedError(f"q/gates dtype {q.dtype}/{gates.dtype}: the triton decode kernel "
                                  "supports fp16/bf16/fp32 (use backend='torch' for fp64)")
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        raise NotImplementedError(f"d_k={q.shape[-1]} / d_v={v.shape[-1]} exceed {MAX_HEAD_DIM}")


def decode_plan(*, rows_h: int, n_cap: int, s_cap: int, l: int, d: int, l_sel: int, n_sel: int,
                w: int, target: int, cmp_tile: int) -> dict:
    """Launch geometry from capacities only (so a captured graph fits every later step).

    rows_h = B*Tq*H programs per split; n_cap compressed-token slots; s_cap raw-token slots;
    target = wanted programs per split-K launch.
    """
    r, u = l // d, l_sel // d
    bn = max(16, next_pow2(max(cmp_tile, r + u)))
    nbj = (bn - (r - 1)) // u                       # selection blocks a sub-tile owns
    ccs = nbj * u
    nb_vis_cap = (n_cap + r - 1 + u - 1) // u if n_cap > 0 else 0
    nsub = max(1, triton.cdiv(nb_vis_cap, nbj))
    want = max(1, triton.cdiv(target, rows_h))
    subs = triton.cdiv(nsub, min(want, nsub))
    nch = triton.cdiv(nsub, subs)
    bw = min(WIN_TILE, max(16, next_pow2(w)))
    nwc = triton.cdiv(min(w, s_cap), bw)
    spb = triton.cdiv(n_sel, min(want, n_sel))
    nss = triton.cdiv(n_sel, spb)
    nb_elig = (max(s_cap, 1) - 1) // l_sel + 1
    return dict(BN=bn, NBJ=nbj, NBJ_PAD=max(16, next_pow2(nbj)), CCS=ccs, NSUB=nsub, NBCAP=nsub * nbj,
                SUBS=subs, NCH=nch, BW=bw, NWC=nwc, SPB=spb, NSS=nss, NB_P2=max(16, next_pow2(nb_elig)))


def nsa_decode_triton(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                      v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                      *, pos0: int | torch.Tensor, win_pos0: int | torch.Tensor, l: int, d: int,
                      l_sel: int, n_sel: int, w: int, scale: float,
                      target_programs: int | None = None,
                      cmp_tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA for queries at absolute positions pos0 .. pos0+Tq-1 against cache buffers (no checks of
    lengths here: nsa.ops.nsa_decode validates the int form).

    q [B,Tq,HQ,dk], gates [B,Tq,HQ,3]; k_cmp/v_cmp [B,Ncap,H,*] (compressed tokens; those visible at
    t are read), k_slc/v_slc [B,Scap,H,*] (raw tokens 0..t), k_win/v_win [B,Swcap,H,*] (row r holds
    absolute position win_pos0 + r). pos0 / win_pos0: Python ints, or int device tensors of shape
    [1] or [B] (then nothing on the host depends on them: a CUDA graph of this call replays at any
    position that fits the buffers). scale: the softmax scale. target_programs: split-K size
    (default TUNE["per_sm"] x multiprocessors); cmp_tile: compressed tokens per sub-tile load (a
    power of two, default TUNE["cmp_tile"]; tests shrink it). Returns (o [B,Tq,HQ,dv] in q.dtype,
    block_idx [B,Tq,H,n_sel] int64 ascending, -1 padded).
    """
    _check(q, v_slc, gates)
    B, Tq, HQ, dk = q.shape
    H, dv = k_slc.shape[2], v_slc.shape[3]
    G = HQ // H
    for name, x in (("q", q), ("k_cmp", k_cmp), ("v_cmp", v_cmp), ("k_slc", k_slc), ("v_slc", v_slc),
                    ("k_win", k_win), ("v_win", v_win)):
        if x.shape[1] > 0 and x.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride in its last dim, got strides {x.stride()}")
    dev = q.device
    if target_programs is None:
        target_programs = TUNE["per_sm"] * (_sm_count(dev.index or 0) if dev.type == "cuda" else 4)
    if cmp_tile is None:
        cmp_tile = TUNE["cmp_tile"]
    R = B * Tq
    n_cap = k_cmp.shape[1]
    plan = decode_plan(rows_h=R * H, n_cap=n_cap, s_cap=k_slc.shape[1], l=l, d=d, l_sel=l_sel,
                       n_sel=n_sel, w=w, target=target_programs, cmp_tile=cmp_tile)
    if n_cap == 0:  # nothing compressed yet: any valid pointer, every load is masked off
        k_cmp, v_cmp = k_slc, v_slc
    pos_ptr = isinstance(pos0, torch.Tensor)
    if pos_ptr:
        pos_t, win_t = pos0, win_pos0
        if not isinstance(win_t, torch.Tensor):
            raise ValueError("win_pos0 must be a tensor when pos0 is one (both device-side)")
        spos = pos_t.stride(0) if pos_t.numel() > 1 else 0
        swin = win_t.stride(0) if win_t.numel() > 1 else 0
        pos_base = win_base = 0
    else:
        pos_t = win_t = q  # unused pointers
        spos = swin = 0
        pos_base, win_base = int(pos0), int(win_pos0)
    f32 = dict(device=dev, dtype=torch.float32)
    NCH, NWC, NSS, NSUB = plan["NCH"], plan["NWC"], plan["NSS"], plan["NSUB"]
    sp = torch.empty(R * HQ, plan["NBCAP"], **f32)
    GP = max(16, next_pow2(G))
    ms = torch.empty(R * H, NSUB, GP, **f32)
    # softmax partials (m, l, unnormalised o) of the cmp chunks, window chunks and selection splits
    cm, cl, co = (torch.empty(R, NCH, HQ, *e, **f32) for e in ((), (), (dv,)))
    wm, wl, wo = (torch.empty(R, NWC, HQ, *e, **f32) for e in ((), (), (dv,)))
    sm, sl, so = (torch.empty(R, NSS, HQ, *e, **f32) for e in ((), (), (dv,)))
    bi = torch.empty(B, Tq, H, n_sel, device=dev, dtype=torch.int64)
    o = torch.empty(B, Tq, HQ, dv, device=dev, dtype=q.dtype)
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    prec = dot_precision(q.dtype, q.is_cuda)
    p_prec = "tf32x3" if q.is_cuda else "ieee"     # scores need ~fp32 accuracy whatever q's dtype
    sl2 = scale * LOG2E
    geo = dict(L_CMP=l, STRIDE=d, LSEL=l_sel, POS_PTR=pos_ptr)
    big = max(bdk, bdv) >= 128 and GP >= 16
    nb_p2 = plan["NB_P2"]
    LAST_LAUNCH["cmp"] = _cmp_kernel[(NCH, R * H)](
        q, k_cmp, v_cmp, pos_t, sp, ms, cm, cl, co, q.stride(0), q.stride(1), q.stride(2),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2), v_cmp.stride(0), v_cmp.stride(1), v_cmp.stride(2),
        spos, pos_base, Tq, H, n_cap, NCH, NSUB, plan["NBCAP"], plan["SUBS"], sl2,
        G=G, GP=GP, DK=dk, DV=dv, BDK=bdk, BDV=bdv, BN=plan["BN"], NBJ=plan["NBJ"],
        NBJ_PAD=plan["NBJ_PAD"], DOT_PREC=prec, P_PREC=p_prec,
        num_warps=TUNE["cmp_warps"] if big else 4, num_stages=TUNE["cmp_stages"], **geo)
    LAST_LAUNCH["topn"] = _topn_kernel[(R * H,)](
        pos_t, sp, ms, cm, cl, bi, spos, pos_base, bi.stride(0), bi.stride(1), bi.stride(2),
        Tq, H, n_cap, NCH, NSUB, plan["NBCAP"], plan["SUBS"],
        G=G, GP=GP, GC=min(GP, max(1, 16384 // nb_p2)), NBJ=plan["NBJ"], NSEL=n_sel,
        NSEL_P2=max(2, next_pow2(n_sel)), NB_P2=nb_p2, NCH_P2=max(2, next_pow2(NCH)), FSTEP=FORCED_STEP,
        num_warps=TUNE["topn_warps"] if nb_p2 >= 1024 else (8 if nb_p2 >= 256 else 4), **geo)
    LAST_LAUNCH["slc_win"] = _slc_win_kernel[(NSS + NWC, R * H)](
        q, k_slc, v_slc, k_win, v_win, pos_t, win_t, bi, sm, sl, so, wm, wl, wo,
        q.stride(0), q.stride(1), q.stride(2), k_slc.stride(0), k_slc.stride(1), k_slc.stride(2),
        v_slc.stride(0), v_slc.stride(1), v_slc.stride(2), k_win.stride(0), k_win.stride(1), k_win.stride(2),
        v_win.stride(0), v_win.stride(1), v_win.stride(2), spos, swin, pos_base, win_base,
        bi.stride(0), bi.stride(1), bi.stride(2), Tq, H, NSS, NWC, sl2,
        G=G, GP=GP, DK=dk, DV=dv, BDK=bdk, BDV=bdv, LSEL=l_sel, NSEL=n_sel, SPB=plan["SPB"],
        SPB_P2=max(2, next_pow2(plan["SPB"])), BS=min(max(16, next_pow2(l_sel)), 64), W=w, BW=plan["BW"],
        POS_PTR=pos_ptr, DOT_PREC=prec, num_warps=TUNE["slc_warps"] if big else 4,
        num_stages=TUNE["slc_stages"])
    LAST_LAUNCH["combine"] = _combine_kernel[(R * HQ,)](
        pos_t, gates, o, cm, cl, co, wm, wl, wo, sm, sl, so, spos, pos_base,
        gates.stride(0), gates.stride(1), gates.stride(2), gates.stride(3),
        o.stride(0), o.stride(1), o.stride(2), Tq, H, n_cap, NCH, NSS, plan["SUBS"],
        G=G, DV=dv, BDV=bdv, W=w, NBJ=plan["NBJ"], NWC=NWC, NWC_P2=max(2, next_pow2(NWC)),
        NSS_P2=max(2, next_pow2(NSS)), BW=plan["BW"], CB=max(2, min(64, next_pow2(NCH))), num_warps=4, **geo)
    return o, bi
