"""NSA decode on Triton: a few query tokens per sequence (usually one) against the KV cache.

Four launches, every grid sized from buffer capacities (never from the current length),
and the query position read from a device tensor when one is given, so one CUDA graph replays every
step. R = B*Tq query rows, H kv heads, G = HQ/H query heads per kv head; grids list the fastest
axis first (the kv heads of one row sit side by side, so they stream the same cache rows together).

1. ``_cmp_kernel``    grid (H, NCH, R)
   Split-K over the compressed tokens (flash-decoding), NCH chunks of SUBS sub-tiles sized for about
   one resident wave. A sub-tile loads CCS own compressed tokens plus an (r-1)-token halo, so the
   NBJ selection blocks it owns get their whole score from it: per head, p = exp2(x - m_sub) is
   mapped onto the blocks with the (loop-invariant) overlap counts, sp[g, j] and m_sub[g] go to
   scratch. The chunk's softmax partial (m, l, o) is always written (neutral -inf/0/0 when the chunk
   saw no visible token), so later kernels need no position to know what is valid.
2. ``_score_kernel``  grid (NSL, H, R)
   Block slice s (SL blocks): lse_g from the chunk partials, group scores
   s[j] = sum_g exp2(m_sub[g] - lse_g) * sp[g, j], and the comparison key of nsa.ops.common (score
   grid 2**-20 of the normalised score, forced blocks by priority, ties to the lower index; one
   unique int64 per block, -1 when not eligible). Only the slice's best CK = min(SL, KR) keys can be
   among the top n_sel (KR = next_pow2(n_sel)): a bitonic sort picks them, they go to scratch as
   candidates (SL is at least NB/16, so there are at most 16*KR per row and kv head). The last
   slice program of a (row, kv head) to finish (a split-K semaphore: an acq_rel counter it resets,
   so the counters stay zero between launches) merges the slices' sorted lists (a bitonic merge
   tree: slices alternate direction, so a pair's elementwise max holds their best KR) into slot k =
   the k-th best key's block, and block_idx (ascending, -1 padded). Keys are unique, so the result
   is deterministic.
3. ``_slc_win_kernel`` grid (H, NSS + NWC, R)
   Selection programs read the block ids of their SPB slots and attend over them; window programs
   attend over WSUB*TW window tokens.
   Key tiles are dealt evenly over the programs. Softmax partials.
4. ``_combine_kernel`` grid (HQ, R): merges the three branches' partials and applies the gates.

The `pdl` knob (nsa/ops/tuning.py DecodeKnobs) makes launches 2-4 programmatic dependent launches
(each kernel lets its dependent start early; the dependent waits with griddepcontrol.wait right before
reading the previous results): a gain for few rows, a loss for many (bandwidth-bound).

Shapes: q [B,Tq,HQ,dk], k_cmp/v_cmp [B,Ncap,H,*], k_slc/v_slc [B,Scap,H,*], k_win/v_win [B,Swcap,H,*]
(linear from win_pos0, or a ring of win_ring rows: position p at row p % win_ring),
gates [B,Tq,HQ,3]; any strides with a unit last dim. Forward only (decode is inference).
"""
from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import FORCED_STEP, LOG2E, decode_signature
from ..tuning import DecodeTuning
from . import check_supported
from ._utils import dot_precision, next_pow2
from .attn import online_softmax_step
# _COUNTERS / CPU_SMS / decode_plan stay reachable here for tests and benchmarks, and bench_decode.py swaps
# this module's _launch_with_pdl_fallback to time the first n launches
from .decode_launch import (_COUNTERS, _DIRECT, _PDL, CPU_SMS, _counters,  # noqa: F401
                            _launch_with_pdl_fallback, _sm_count, _warps, decode_plan, direct_launch_ok,
                            kept_handles, launch_kept, plan_caps, plan_of_caps)
from .scores import SCORE_GRID, _bitonic_sort, _merge_rows



# ----------------------------------------------------------------------------------------- helpers
@triton.jit
def _pdl_launch_dependents(PDL: tl.constexpr):
    if PDL:  # griddepcontrol: a no-op when the launch was not programmatic
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _pdl_wait(PDL: tl.constexpr):
    if PDL:  # waits until the previous kernel finished and its writes are visible
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _query_pos(POS, spos, pos_base, b, iq, POS_PTR: tl.constexpr):
    """Absolute position of query row (b, iq): device tensor (CUDA-graph replay) or host int."""
    if POS_PTR:
        t = tl.load(POS + b * spos).to(tl.int64) + iq
    else:
        t = pos_base.to(tl.int64) + iq
    return t


@triton.jit
def _n_visible(t, NBUF, L_CMP: tl.constexpr, STRIDE: tl.constexpr):
    """Compressed tokens visible at t (block i visible iff i*d + l - 1 <= t), capped by the buffer."""
    return tl.minimum(tl.where(t + 1 >= L_CMP, (t + 1 - L_CMP) // STRIDE + 1, 0), NBUF)


@triton.jit
def _attend_tile(q, k, v, ok, m_run, l_run, acc, scale_log2, DOT_PREC: tl.constexpr):
    """One online-softmax step of q [GP, BDK] over a key tile k/v [BN, *] with valid columns ok."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
    s = tl.where(ok[None, :], s, float("-inf"))
    return online_softmax_step(s, v, m_run, l_run, acc, DOT_PREC)


@triton.jit
def _dot_split3(p, cnt, SPLIT: tl.constexpr):
    """p [M, K] fp32 @ cnt [K, N] (small integers) with fp32 accuracy.

    SPLIT (CUDA): p = p1 + p2 + p3 in bf16 (each residual exact in fp32, the sum exact to ~2**-25)
    and three bf16 MMAs accumulating in fp32 -- as exact as a tf32x3 dot and far lighter on
    registers. Else one fp32 "ieee" dot (the interpreter, whose bf16 dots are not usable)."""
    if not SPLIT:
        return tl.dot(p, cnt, input_precision="ieee")
    cnt = cnt.to(tl.bfloat16)
    p1 = p.to(tl.bfloat16)
    r = p - p1.to(tl.float32)
    p2 = r.to(tl.bfloat16)
    p3 = (r - p2.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(p3, cnt, out_dtype=tl.float32)
    acc = tl.dot(p2, cnt, acc)
    return tl.dot(p1, cnt, acc)


@triton.jit
def _merge(m, l, o, ok):
    """Normalised softmax merge of partials m/l [N], o [N, BDV] where ok; 0 when nothing merged."""
    m = tl.where(ok, m, float("-inf"))
    mx = tl.max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    wt = tl.where(ok, tl.exp2(m - mx), 0.0)
    tot = tl.sum(wt * l, 0)
    osum = tl.sum(wt[:, None] * o, 0)
    return tl.where(tot > 0, osum / tl.maximum(tot, 1e-30), 0.0)


# ----------------------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["pos_base"])
def _cmp_kernel(Q, KC, VC, POS, SP, MS, CM, CL, CO, sqb, sqt, sqh, skcb, skct, skch, svcb, svct, svch,
                spos, pos_base, Tq, H, NBUF, NCH, NSUB, NBCAP, SUBS, scale_log2,
                G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BDK: tl.constexpr, BDV: tl.constexpr, L_CMP: tl.constexpr, STRIDE: tl.constexpr,
                LSEL: tl.constexpr, BN: tl.constexpr, NBJ: tl.constexpr, NBJ_PAD: tl.constexpr,
                POS_PTR: tl.constexpr, PDL: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr):
    """Split-K compressed attention + per-head block-score partials of one chunk (see module doc)."""
    R: tl.constexpr = LSEL // STRIDE          # stride chunks per selection block (u)
    LC: tl.constexpr = L_CMP // STRIDE        # stride chunks per compression block (r)
    CCS: tl.constexpr = NBJ * R               # own compressed tokens per sub-tile
    h = tl.program_id(0)
    c = tl.program_id(1)
    row = tl.program_id(2)
    _pdl_launch_dependents(PDL)
    rh = row * H + h
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    t = _query_pos(POS, spos, pos_base, b, iq, POS_PTR)
    g = tl.arange(0, GP)
    g_ok = g < G
    hq = (h * G + g).to(tl.int64)
    HQ = H * G
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    dk_ok = offs_dk[None, :] < DK
    dv_ok = offs_dv[None, :] < DV
    q = tl.load(Q + b * sqb + iq * sqt + hq[:, None] * sqh + offs_dk[None, :],
                mask=g_ok[:, None] & dk_ok, other=0.0)                          # [GP, BDK]
    n_vis = _n_visible(t, NBUF, L_CMP, STRIDE)
    # sub-tiles holding a visible token (their load window starts r-1 tokens early)
    st_end = tl.where(n_vis > 0, (n_vis + LC - 1 + CCS - 1) // CCS, 0)
    st_lo = c * SUBS
    st_hi = tl.minimum(st_lo + SUBS, st_end).to(tl.int32)
    # overlap (in stride chunks) of the sub-tile's tokens with the NBJ blocks it owns: the same for
    # every sub-tile, so it is built once. Token rel (relative to the first own token) covers stride
    # chunks [rel, rel + r - 1]; owned block jc covers [jc*u, jc*u + u - 1].
    rel = tl.arange(0, BN) - (LC - 1)
    jcol = tl.arange(0, NBJ_PAD)
    lo = tl.maximum(rel[:, None], (jcol * R)[None, :])
    hi = tl.minimum(rel[:, None] + LC - 1, (jcol * R + R - 1)[None, :])
    cnt = tl.where((hi >= lo) & (jcol < NBJ)[None, :], hi - lo + 1, 0).to(tl.float32)   # [BN, NBJ_PAD]
    own_rel = (rel >= 0) & (rel < CCS)
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BDV], tl.float32)
    kc_base = KC + b * skcb + h * skch
    vc_base = VC + b * svcb + h * svch
    sp_row = (row * HQ + hq).to(tl.int64)[:, None] * NBCAP
    sp_ok = g_ok[:, None] & (jcol < NBJ)[None, :]
    ms_row = rh.to(tl.int64) * NSUB
    for st in range(st_lo, st_hi):
        ki = st * CCS + rel                                                     # [BN] with the halo
        k_ok = (ki >= 0) & (ki < n_vis)
        own = k_ok & own_rel
        ki64 = ki.to(tl.int64)
        k = tl.load(kc_base + ki64[:, None] * skct + offs_dk[None, :], mask=k_ok[:, None] & dk_ok,
                    other=0.0, eviction_policy="evict_first")
        v = tl.load(vc_base + ki64[:, None] * svct + offs_dv[None, :], mask=own[:, None] & dv_ok,
                    other=0.0, eviction_policy="evict_first")
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2        # [GP, BN]
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_s = tl.max(s, 1)                                                      # finite: a token is visible
        p = tl.exp2(s - m_s[:, None])
        sp = _dot_split3(p, cnt, SPLIT)                                              # [GP, NBJ_PAD]
        tl.store(SP + sp_row + (st * NBJ + jcol)[None, :], sp, mask=sp_ok)
        tl.store(MS + (ms_row + st) * GP + g, m_s)
        # online softmax over the sub-tile's own tokens
        m_new = tl.maximum(m_run, m_s)
        alpha = tl.exp2(m_run - m_new)
        p_own = tl.where(own[None, :], p * tl.exp2(m_s - m_new)[:, None], 0.0)
        l_run = l_run * alpha + tl.sum(p_own, 1)
        acc = acc * alpha[:, None] + tl.dot(p_own.to(v.dtype), v, input_precision=DOT_PREC)
        m_run = m_new
    part = (row * NCH + c).to(tl.int64) * HQ + hq                               # rows of [R, NCH, HQ]
    tl.store(CM + part, m_run, mask=g_ok)
    tl.store(CL + part, l_run, mask=g_ok)
    tl.store(CO + part[:, None] * DV + offs_dv[None, :], acc, mask=g_ok[:, None] & dv_ok)


@triton.jit(do_not_specialize=["pos_base"])
def _score_kernel(POS, SP, MS, CM, CL, CAND, CNT, SEL, BI, spos, pos_base, sbb, sbt, sbh, Tq, H, NBUF, NCH,
                  NSUB, NBCAP, G: tl.constexpr, GP: tl.constexpr, GC: tl.constexpr, L_CMP: tl.constexpr,
                  STRIDE: tl.constexpr, LSEL: tl.constexpr, NBJ: tl.constexpr, SL: tl.constexpr,
                  LOGSL: tl.constexpr, NSL: tl.constexpr, LOGNSL: tl.constexpr, NSEL: tl.constexpr,
                  KR: tl.constexpr, LOGKR: tl.constexpr,
                  CK: tl.constexpr, NCAND: tl.constexpr, NCP: tl.constexpr, LOGNCP: tl.constexpr,
                  NB_P2: tl.constexpr, NCH_P2: tl.constexpr, FSTEP: tl.constexpr, POS_PTR: tl.constexpr,
                  PDL: tl.constexpr):
    """Group scores and comparison keys of one slice of SL blocks, its best CK keys as candidates;
    the last slice program of the (row, kv head) to finish picks the top n_sel (see module doc)."""
    R: tl.constexpr = LSEL // STRIDE
    LC: tl.constexpr = L_CMP // STRIDE
    s_id = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    _pdl_launch_dependents(PDL)
    rh = row * H + h
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    HQ = H * G
    t = _query_pos(POS, spos, pos_base, b, iq, POS_PTR)
    cur = t // LSEL                                        # block of t; eligible blocks are 0..cur
    n_vis = _n_visible(t, NBUF, L_CMP, STRIDE)
    j = s_id * SL + tl.arange(0, SL)
    # block j has a visible compressed token (n_vis > 0 in vector form: the interpreter wants it)
    vis = (j * R - (LC - 1) < n_vis) & (j <= cur) & ((tl.zeros([SL], tl.int64) + n_vis) > 0)
    in_cap = j < NBCAP                                     # scratch rows exist (content valid where vis)
    st = (j // NBJ).to(tl.int64)
    cidx = tl.arange(0, NCH_P2)
    _pdl_wait(PDL)
    ssum = tl.zeros([SL], tl.float32)
    for g0 in tl.static_range(0, GP, GC):                  # GC heads at a time (register budget)
        gg = g0 + tl.arange(0, GC)
        g_ok = gg < G
        hq = (h * G + gg).to(tl.int64)
        coff = (row * NCH + cidx).to(tl.int64)[:, None] * HQ + hq[None, :]       # [NCH_P2, GC]
        cmask = (cidx < NCH)[:, None] & g_ok[None, :]
        cm = tl.load(CM + coff, mask=cmask, other=float("-inf"))
        cl = tl.load(CL + coff, mask=cmask, other=0.0)
        lmask = g_ok[:, None] & in_cap[None, :]
        ms = tl.load(MS + (rh.to(tl.int64) * NSUB + st)[None, :] * GP + gg[:, None], mask=lmask, other=0.0)
        sp = tl.load(SP + (row * HQ + hq)[:, None] * NBCAP + j[None, :], mask=lmask, other=0.0)
        mx = tl.max(cm, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        lse = mx + tl.log2(tl.maximum(tl.sum(tl.exp2(cm - mx[None, :]) * cl, 0), 1e-30))   # [GC]
        val = tl.exp2(ms - lse[:, None]) * sp
        ssum += tl.sum(tl.where(g_ok[:, None] & vis[None, :], val, 0.0), 0)
    # comparison grid of nsa.ops.common: round-half-even(s * 2**SCORE_BITS * d / (G*l)) in fp64
    mult = tl.full([SL], SCORE_GRID * STRIDE, tl.float64) / (G * L_CMP)
    x = ssum.to(tl.float64) * mult
    grid = ((x + 4503599627370496.0) - 4503599627370496.0).to(tl.int64)   # rint for 0 <= x < 2**52
    prio = tl.where(j == cur, 3, tl.where(j == 0, 2, tl.where(j == cur - 1, 1, 0))).to(tl.int64)
    # one unique int64 key: priority, then grid score, then the lower index; -1 = not eligible
    key = tl.where(j <= cur, (prio * FSTEP + grid) * NB_P2 + (NB_P2 - 1 - j), -1)
    cbase = CAND + rh.to(tl.int64) * NCAND
    if SL > KR:  # only the slice's best KR can reach the top n_sel: sort ascending, keep the last KR;
        # stored descending for even slices, ascending for odd ones (pairs merge without a flip)
        srt = _bitonic_sort(tl.reshape(key, [1, SL]), 1, SL, LOGSL, 0)
        kk = tl.arange(0, KR)
        pos = tl.where(s_id % 2 == 0, KR - 1 - kk, kk)
        tl.store(cbase + s_id * CK + pos, tl.max(tl.reshape(srt, [SL // KR, KR]), 0))
    else:
        tl.store(cbase + s_id * CK + tl.arange(0, SL), key)
    # the last of the NSL slice programs takes the top n_sel of all candidates: split-K semaphore
    # (all threads' stores, a CTA barrier, then one release-acquire increment; the last resets it).
    # The barrier is needed with one slice too: the tail reads what other threads of this program
    # stored (a GPU race the sequential interpreter cannot show: found by the 8k GPU test).
    tl.debug_barrier()
    last = True
    if NSL > 1:
        done = tl.atomic_add(CNT + rh, 1, sem="acq_rel", scope="gpu")
        last = done == NSL - 1
    if last:
        if NSL > 1:
            tl.atomic_xchg(CNT + rh, 0, sem="relaxed", scope="gpu")
        ci = tl.arange(0, NCP)
        ck = tl.load(cbase + ci, mask=ci < NCAND, other=-1, cache_modifier=".cg")
        if SL > KR and NSL > 1:
            # merge tree over the sorted slices: a (descending, ascending) pair's elementwise max
            # holds their best KR as a bitonic row; one merge sorts it, rows alternating direction
            tree = tl.reshape(ck, [NSL, KR])
            for lev in tl.static_range(LOGNSL):
                tree = tl.max(tl.reshape(tree, [NSL >> (lev + 1), 2, KR]), 1)
                tree = _merge_rows(tree, NSL >> (lev + 1), KR, LOGKR, 1 - tl.arange(0, NSL >> (lev + 1)) % 2)
            top = tl.reshape(tree, [KR])                                     # descending: slot k = top[k]
        else:
            allc = _bitonic_sort(tl.reshape(ck, [1, NCP]), 1, NCP, LOGNCP, 1)    # descending
            top = tl.max(tl.reshape(allc, [NCP // KR, KR]), 0)                   # the best KR keys, ranked
        kr = tl.arange(0, KR)
        jtop = tl.where((top >= 0) & (kr < NSEL), NB_P2 - 1 - top % NB_P2, -1)
        tl.store(SEL + rh.to(tl.int64) * KR + kr, jtop)                      # slot (rank) -> block
        # block_idx: the selected blocks ascending, -1 padded
        big = tl.where(jtop < 0, 4611686018427387904, jtop)                  # -1 sorts last
        dst = tl.sum((big[None, :] < jtop[:, None]).to(tl.int32), 1)         # rank by block id
        out = BI + b * sbb + iq.to(tl.int64) * sbt + h * sbh
        tl.store(out + dst, jtop, mask=jtop >= 0)
        n_chosen = tl.sum((jtop >= 0).to(tl.int32), 0)
        tl.store(out + kr, tl.full([KR], -1, tl.int64), mask=(kr >= n_chosen) & (kr < NSEL))


@triton.jit(do_not_specialize=["pos_base", "win_base"])
def _slc_win_kernel(Q, KS, VS, KW, VW, POS, WIN0, SEL, XM, XL, XO,
                    sqb, sqt, sqh, sksb, skst, sksh, svsb, svst, svsh, skwb, skwt, skwh, svwb, svwt, svwh,
                    spos, swin, pos_base, win_base, wmod, Tq, H, NSS, NP2, scale_log2,
                    G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    BDK: tl.constexpr, BDV: tl.constexpr, LSEL: tl.constexpr, NSEL: tl.constexpr,
                    NSEL_P2: tl.constexpr, SPB: tl.constexpr, TW: tl.constexpr, W: tl.constexpr,
                    WSUB: tl.constexpr, POS_PTR: tl.constexpr, PDL: tl.constexpr, DOT_PREC: tl.constexpr):
    """p < NSS: attention over the blocks of slots p*SPB ..; else window chunk p - NSS. Both kinds
    run one loop of TW-token tiles (one pipeline, one set of shared-memory buffers)."""
    NBS: tl.constexpr = (LSEL + TW - 1) // TW              # key tiles per selected block
    h = tl.program_id(0)
    p = tl.program_id(1)
    row = tl.program_id(2)
    _pdl_launch_dependents(PDL)
    rh = row * H + h
    b = (row // Tq).to(tl.int64)
    iq = row % Tq
    t = _query_pos(POS, spos, pos_base, b, iq, POS_PTR)
    g = tl.arange(0, GP)
    g_ok = g < G
    hq = (h * G + g).to(tl.int64)
    HQ = H * G
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    dk_ok = offs_dk[None, :] < DK
    dv_ok = offs_dv[None, :] < DV
    tw = tl.arange(0, TW)
    q = tl.load(Q + b * sqb + iq * sqt + hq[:, None] * sqh + offs_dk[None, :],
                mask=g_ok[:, None] & dk_ok, other=0.0)
    is_slc = p < NSS
    sb = SEL + rh.to(tl.int64) * NSEL_P2                    # slot -> block, slots in rank order
    if is_slc:
        _pdl_wait(PDL)
    if POS_PTR:
        w0 = tl.load(WIN0 + b * swin).to(tl.int64)             # absolute position of window row 0
    else:
        w0 = win_base.to(tl.int64)
    # window tiles: positions lo_w + c*TW + [0, TW); ring rows wrap at most once inside a tile
    c_w = (p - NSS) * WSUB
    lo_w = tl.maximum(t - W + 1, 0)
    wm = tl.maximum(wmod, 1)
    ring0 = (lo_w + c_w * TW) % wm
    k_base = tl.where(is_slc, KS + b * sksb + h * sksh, KW + b * skwb + h * skwh)
    v_base = tl.where(is_slc, VS + b * svsb + h * svsh, VW + b * svwb + h * svwh)
    k_st = tl.where(is_slc, skst, skwt)
    v_st = tl.where(is_slc, svst, svwt)
    n_it = tl.where(is_slc, SPB * NBS, WSUB)
    m_run = tl.full([GP], float("-inf"), tl.float32)
    l_run = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BDV], tl.float32)
    for it in range(n_it):
        slot = p * SPB + it // NBS
        jsel = tl.load(sb + slot, mask=is_slc & (slot < NSEL), other=-1)
        kk2 = (it % NBS) * TW + tw
        kp_s = jsel * LSEL + kk2                                                # -1 (empty slot): < 0
        kp_w = lo_w + (c_w + it) * TW + tw                                       # absolute positions
        r_ring = (ring0 + it * TW) % wm + tw            # valid rows span < w <= wmod: one wrap at most
        r_ring = tl.where(r_ring >= wm, r_ring - wm, r_ring)
        r_w = tl.where(wmod > 0, r_ring, kp_w - w0)                              # ring or linear rows
        rows = tl.where(is_slc, kp_s, r_w)
        ok = tl.where(is_slc, (kp_s >= 0) & (kk2 < LSEL) & (kp_s <= t), kp_w <= t)
        k = tl.load(k_base + rows[:, None] * k_st + offs_dk[None, :], mask=ok[:, None] & dk_ok, other=0.0)
        v = tl.load(v_base + rows[:, None] * v_st + offs_dv[None, :], mask=ok[:, None] & dv_ok, other=0.0)
        m_run, l_run, acc = _attend_tile(q, k, v, ok, m_run, l_run, acc, scale_log2, DOT_PREC)
    part = (row * NP2 + p).to(tl.int64) * HQ + hq
    tl.store(XM + part, m_run, mask=g_ok)
    tl.store(XL + part, l_run, mask=g_ok)
    tl.store(XO + part[:, None] * DV + offs_dv[None, :], acc, mask=g_ok[:, None] & dv_ok)


@triton.jit
def _combine_kernel(GT, O, CM, CL, CO, XM, XL, XO, sgb, sgt, sgh, sgk, sob, sot, soh, Tq, NCH, NSS, NP2,
                    HQ: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, NCH_P2: tl.constexpr,
                    NP2_P2: tl.constexpr, PDL: tl.constexpr):
    """o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win for one (row, query head)."""
    hq = tl.program_id(0)
    row = tl.program_id(1)
    b = (row // Tq).to(tl.int64)
    iq = (row % Tq).to(tl.int64)
    offs_dv = tl.arange(0, BDV)
    dv_ok = offs_dv[None, :] < DV
    gp = GT + b * sgb + iq * sgt + hq * sgh
    g0 = tl.load(gp).to(tl.float32)
    g1 = tl.load(gp + sgk).to(tl.float32)
    g2 = tl.load(gp + 2 * sgk).to(tl.float32)
    c = tl.arange(0, NCH_P2)
    c_ok = c < NCH
    x = tl.arange(0, NP2_P2)
    x_ok = x < NP2
    crow = (row * NCH + c).to(tl.int64) * HQ + hq
    xrow = (row * NP2 + x).to(tl.int64) * HQ + hq
    _pdl_wait(PDL)
    cm = tl.load(CM + crow, mask=c_ok, other=float("-inf"))
    cl = tl.load(CL + crow, mask=c_ok, other=0.0)
    co = tl.load(CO + crow[:, None] * DV + offs_dv[None, :], mask=c_ok[:, None] & dv_ok, other=0.0)
    xm = tl.load(XM + xrow, mask=x_ok, other=float("-inf"))
    xl = tl.load(XL + xrow, mask=x_ok, other=0.0)
    xo = tl.load(XO + xrow[:, None] * DV + offs_dv[None, :], mask=x_ok[:, None] & dv_ok, other=0.0)
    o_cmp = _merge(cm, cl, co, c_ok)                       # exactly 0 when no compressed token is visible
    o_slc = _merge(xm, xl, xo, x_ok & (x < NSS))
    o_win = _merge(xm, xl, xo, x_ok & (x >= NSS))
    o = g0 * o_cmp + g1 * o_slc + g2 * o_win
    tl.store(O + b * sob + iq * sot + hq * soh + offs_dv, o.to(O.dtype.element_ty), mask=offs_dv < DV)


# ----------------------------------------------------------------------------------------------
# launcher: what a call signature fixes is worked out once (_Launcher); per call the positions, two output
# allocations, the argument tuples and the launches (geometry, semaphores, launching: decode_launch.py)


class _Geometry(NamedTuple):
    """The launch geometry of one plan (plan_of_caps) for one launcher: grids, constexprs, scratch shapes and
    the plan's integer arguments of each kernel."""

    grids: tuple
    kws: tuple                 # cmp, score, slc_win, combine constexprs and launch options
    scratch: tuple             # (shape, dtype) of sp, ms, cm, cl, co, xm, xl, xo, cand, sel
    ints: tuple                # cmp, score, slc_win, combine: the plan's integer arguments
    caps: tuple                # the plan_caps it was planned for (names it in keys: hashable)


def _contiguous_strides(shape: tuple) -> tuple:
    """torch's strides of a fresh contiguous tensor of this shape."""
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(st))


class _Launcher:
    """One call signature of nsa_decode_triton (decode_signature: shapes but the caches' lengths, strides,
    dtypes, device) with its hyper-parameters and knobs: checks, knobs, strides and constexprs worked out
    once. Per capacity reduction (plan_caps) a _Geometry; per (stream, thread) one set of split-K scratch,
    reused while the geometry stays (kernels on one stream run in order; every element a kernel reads, an
    earlier one of the same call wrote). Inside a CUDA-graph capture the scratch is fresh and not kept."""

    def __init__(self, t: tuple, *, l: int, d: int, l_sel: int, n_sel: int, w: int, win_ring: int, tuning,
                 target_programs: int | None, cmp_tile: int | None, pos_ptr: bool) -> None:
        q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates = t
        check_supported(q, v_slc, gates)
        B, Tq, HQ, dk = q.shape
        H, dv = k_slc.shape[2], v_slc.shape[3]
        for name, x in zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win"), t):
            if x.shape[1] > 0 and x.stride(-1) != 1:
                raise ValueError(f"{name} needs a unit stride in its last dim, got strides {x.stride()}")
        dev = q.device
        self.tuning = tuning       # held: the signature names it by id
        self.rows_h, self.cuda, self.dev = B * Tq * H, q.is_cuda, dev
        tn = (tuning or DecodeTuning()).knobs(self.rows_h)
        self.sms = _sm_count(dev.index or 0) if dev.type == "cuda" else CPU_SMS
        if target_programs is not None:
            per_sm = max(1, target_programs) / self.sms
            tn = dataclasses.replace(tn, cmp_per_sm=per_sm, sw_per_sm=per_sm)
        if cmp_tile is not None:
            tn = dataclasses.replace(tn, cmp_tile=cmp_tile)
        self.tn, self.hp, self.win_ring, self.pos_ptr = tn, (l, d, l_sel, n_sel, w), int(win_ring), pos_ptr
        self.has_cmp = k_cmp.shape[1] > 0   # else any valid pointer stands in: every load is masked off
        kc, vc = (k_cmp, v_cmp) if self.has_cmp else (k_slc, v_slc)
        self.shape = (B, Tq, HQ, H, dk, dv, HQ // H, max(16, next_pow2(HQ // H)))
        self.o_shape, self.bi_shape = (B, Tq, HQ, dv), (B, Tq, H, n_sel)
        s3 = [x.stride()[:3] for x in (q, kc, vc, k_slc, v_slc, k_win, v_win)]
        self.cmp_strides = s3[0] + s3[1] + s3[2]
        self.sw_strides = s3[0] + s3[3] + s3[4] + s3[5] + s3[6]
        self.bi_strides = _contiguous_strides(self.bi_shape)[:3]
        self.comb_strides = gates.stride() + _contiguous_strides(self.o_shape)[:3]
        self.pdl = bool(tn.pdl) and q.is_cuda
        self.names = ("cmp", "score", "slc_win", "combine")
        self.kernels = (_cmp_kernel, _score_kernel, _slc_win_kernel, _combine_kernel)
        self._direct: dict = {}   # specialisation (see __call__) -> kept compiled-kernel handles
        self.bd = (max(16, next_pow2(dk)), max(16, next_pow2(dv)))
        self.prec = dot_precision(q.dtype, q.is_cuda)
        self._caps = self._geo = None
        self._geos: dict = {}
        self._scr: dict = {}

    def geometry(self, n_cap: int, s_cap: int) -> _Geometry:
        l, d, l_sel, n_sel, w = self.hp
        caps = plan_caps(n_cap, s_cap, l=l, d=d, l_sel=l_sel, w=w)
        geo = self._geos.get(caps)
        if geo is None:
            if len(self._geos) >= 64:   # a cache grown far: the old geometries are not needed again
                self._geos.clear()
            geo = self._geos[caps] = self._build(plan_of_caps(self.rows_h, caps, l, d, l_sel, n_sel, self.sms,
                                                              self.tn), caps)
        self._caps, self._geo = (n_cap, s_cap), geo
        return geo

    def _build(self, plan, caps: tuple) -> _Geometry:
        B, Tq, HQ, H, dk, dv, G, GP = self.shape
        l, d, l_sel, n_sel, w = self.hp
        tn, R, (bdk, bdv) = self.tn, B * Tq, self.bd
        NCH, NP2, NSUB, SL, NSL = plan["NCH"], plan["NP2"], plan["NSUB"], plan["SL"], plan["NSL"]
        geo = dict(L_CMP=l, STRIDE=d, LSEL=l_sel, POS_PTR=self.pos_ptr)
        nch_p2, np2_p2 = max(2, next_pow2(NCH)), max(2, next_pow2(NP2))
        gc = GP
        while gc > 1 and gc * max(SL, nch_p2) > 4096:   # [GC, SL] / [NCH_P2, GC] tiles stay small
            gc //= 2
        log2 = {k: plan[k].bit_length() - 1 for k in ("SL", "NSL", "NSEL_P2", "NCP")}
        kws = (dict(G=G, GP=GP, DK=dk, DV=dv, BDK=bdk, BDV=bdv, BN=plan["BN"], NBJ=plan["NBJ"],
                    NBJ_PAD=plan["NBJ_PAD"], DOT_PREC=self.prec, SPLIT=self.cuda, num_warps=tn.cmp_warps,
                    num_stages=tn.cmp_stages, **geo),
               dict(G=G, GP=GP, GC=gc, NBJ=plan["NBJ"], SL=SL, LOGSL=log2["SL"], NSL=NSL, LOGNSL=log2["NSL"],
                    NSEL=n_sel, KR=plan["NSEL_P2"], LOGKR=log2["NSEL_P2"], CK=plan["CK"], NCAND=plan["NCAND"],
                    NCP=plan["NCP"], LOGNCP=log2["NCP"], NB_P2=plan["NB_P2"], NCH_P2=nch_p2, FSTEP=FORCED_STEP,
                    num_warps=_warps(tn.score_warps, gc * max(SL, nch_p2)), **geo),
               dict(G=G, GP=GP, DK=dk, DV=dv, BDK=bdk, BDV=bdv, LSEL=l_sel, NSEL=n_sel, NSEL_P2=plan["NSEL_P2"],
                    SPB=plan["SPB"], TW=plan["TW"], W=w, WSUB=plan["WSUB"], POS_PTR=self.pos_ptr,
                    DOT_PREC=self.prec, num_warps=tn.slc_warps, num_stages=tn.slc_stages),
               dict(HQ=HQ, DV=dv, BDV=bdv, NCH_P2=nch_p2, NP2_P2=np2_p2,
                    num_warps=_warps(tn.comb_warps, max(nch_p2, np2_p2) * bdv)))
        f32, i64 = torch.float32, torch.int64
        # split-K partials of the cmp chunks and of the selection/window programs: (m, l, unnormalised o)
        scratch = (((R * HQ, plan["NBCAP"]), f32), ((R * H, NSUB, GP), f32),
                   ((R, NCH, HQ), f32), ((R, NCH, HQ), f32), ((R, NCH, HQ, dv), f32),
                   ((R, NP2, HQ), f32), ((R, NP2, HQ), f32), ((R, NP2, HQ, dv), f32),
                   ((R * H, plan["NCAND"]), i64),      # per-slice best keys
                   ((R * H, plan["NSEL_P2"]), i64))    # slot (rank) -> block
        ints = ((NCH, NSUB, plan["NBCAP"], plan["SUBS"]), (NCH, NSUB, plan["NBCAP"]), (plan["NSS"], NP2),
                (NCH, plan["NSS"], NP2))
        # 3-dim grids throughout: a kept compiled kernel's launcher reads grid[0..2] (decode_launch.launch_kept)
        return _Geometry(((H, NCH, R), (NSL, H, R), (H, NP2, R), (HQ, R, 1)), kws, scratch, ints, caps)

    def _scratch(self, geo: _Geometry, stream, capturing: bool) -> tuple:
        """(split-K scratch, its tensors' 16-byte alignment) for a launch on stream from this thread."""
        if capturing:
            scr = self._allocate(geo)   # replays with the graph, from its pool: not shared with eager calls
            return scr, _aligned(scr)
        where = (stream, threading.get_ident())
        got = self._scr.get(where)
        if got is None or got[0] is not geo:
            scr = self._allocate(geo)
            got = self._scr[where] = (geo, scr, _aligned(scr))
        return got[1], got[2]

    def _allocate(self, geo: _Geometry) -> tuple:
        return tuple(torch.empty(s, device=self.dev, dtype=dt) for s, dt in geo.scratch) + \
            (_counters(self.dev, self.rows_h),)     # zeros, left at zero

    def __call__(self, q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, pos0, win_pos0, scale: float,
                 launch_info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The launches of one call with these tensors (of this launcher's signature) and positions."""
        n_cap, s_cap = k_cmp.shape[1], k_slc.shape[1]
        geo = self._geo if self._caps == (n_cap, s_cap) else self.geometry(n_cap, s_cap)
        if not self.has_cmp:
            k_cmp, v_cmp = k_slc, v_slc
        if self.pos_ptr:
            pos_t, win_t = pos0, win_pos0
            if not isinstance(win_t, torch.Tensor):
                if not self.win_ring:
                    raise ValueError("win_pos0 must be a tensor when pos0 is one (both device-side)")
                win_t = pos_t
            spos = pos_t.stride(0) if pos_t.numel() > 1 else 0
            swin = win_t.stride(0) if win_t.numel() > 1 else 0
            pos_base = win_base = 0
        else:
            pos_t = win_t = q  # unused pointers
            spos = swin = 0
            pos_base, win_base = int(pos0), (0 if self.win_ring else int(win_pos0))
        capturing = self.cuda and torch.cuda.is_current_stream_capturing()
        stream = _raw_stream(self.dev) if self.cuda else None
        (sp, ms, cm, cl, co, xm, xl, xo, cand, sel, cnt), scr_aligned = self._scratch(geo, stream, capturing)
        bi = torch.empty(self.bi_shape, device=self.dev, dtype=torch.int64)
        o = torch.empty(self.o_shape, device=self.dev, dtype=q.dtype)
        Tq, H = self.shape[1], self.shape[3]
        sl2 = scale * LOG2E
        ci, si, wi, ki = geo.ints
        argsets = ((q, k_cmp, v_cmp, pos_t, sp, ms, cm, cl, co) + self.cmp_strides + (spos, pos_base, Tq, H, n_cap)
                   + ci + (sl2,),
                   (pos_t, sp, ms, cm, cl, cand, cnt, sel, bi, spos, pos_base) + self.bi_strides + (Tq, H, n_cap) + si,
                   (q, k_slc, v_slc, k_win, v_win, pos_t, win_t, sel, xm, xl, xo)
                   + self.sw_strides + (spos, swin, pos_base, win_base, self.win_ring, Tq, H) + wi + (sl2,))
        argsets += ((gates, o, cm, cl, co, xm, xl, xo) + self.comb_strides + (Tq,) + ki,)
        # what Triton specialises on and may differ between calls of this signature: 16-byte alignment of the
        # tensors, the compressed count (== 1, % 16), the positions' width and pointer types
        spec = None
        if not capturing and _DIRECT["ok"] is not False and direct_launch_ok():
            ptrs = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, pos_t, win_t, o, bi)
            spec = (geo.caps, scr_aligned, _aligned(ptrs), n_cap == 1, n_cap % 16 == 0,
                    max(pos_base, win_base, n_cap) >= 1 << 31, spos, swin, pos_t.dtype, win_t.dtype,
                    self.pdl and _PDL["ok"] is True)
            handles = self._direct.get(spec)
            if handles is not None and launch_kept(handles, geo.grids, argsets, stream):
                if launch_info is not None:
                    launch_info.update(zip(self.names, (h for h, _ in handles)))
                return o, bi
        specs = list(zip(self.names, self.kernels, geo.grids, argsets, geo.kws))
        compiled: dict = {}
        pdl = _launch_with_pdl_fallback(specs, self.pdl, compiled)
        if launch_info is not None:
            launch_info.update(compiled)
        if spec is not None and pdl is not None:
            handles = kept_handles(specs, compiled, pdl)
            if handles is not None:
                if len(self._direct) >= 64:
                    self._direct.clear()
                self._direct[spec[:-1] + (pdl,)] = handles
        return o, bi


def _aligned(xs) -> tuple:
    """Per tensor of xs whether it is 16-byte aligned (Triton's pointer specialisation)."""
    return tuple(x.data_ptr() % 16 == 0 for x in xs)


def _raw_stream(dev: torch.device) -> int:
    """The current CUDA stream's handle on dev (what Triton launches on), without building a Stream object."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(dev.index) if raw is not None else torch.cuda.current_stream(dev).cuda_stream


_LAUNCHERS: dict[tuple, _Launcher] = {}
MAX_LAUNCHERS = 64   # signatures kept (a few per layer shape); more: start over


def decode_launcher(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                    v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor, *,
                    l: int, d: int, l_sel: int, n_sel: int, w: int, win_ring: int = 0, tuning=None,
                    target_programs: int | None = None, cmp_tile: int | None = None,
                    pos_ptr: bool = False) -> _Launcher:
    """The launcher of these tensors' signature (nsa.ops.common.decode_signature) and arguments, made on its
    first call (NotImplementedError / ValueError as nsa_decode_triton) and kept."""
    t = (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)
    sig = decode_signature(t)
    key = None if sig is None else (sig, l, d, l_sel, n_sel, w, win_ring, id(tuning), target_programs, cmp_tile,
                                    pos_ptr, CPU_SMS)
    la = _LAUNCHERS.get(key) if key is not None else None
    if la is None:
        la = _Launcher(t, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, win_ring=win_ring, tuning=tuning,
                       target_programs=target_programs, cmp_tile=cmp_tile, pos_ptr=pos_ptr)
        if key is not None:
            if len(_LAUNCHERS) >= MAX_LAUNCHERS:
                _LAUNCHERS.clear()
            _LAUNCHERS[key] = la
    return la


def nsa_decode_triton(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                      v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                      *, pos0: int | torch.Tensor, win_pos0: int | torch.Tensor | None, l: int, d: int,
                      l_sel: int, n_sel: int, w: int, scale: float, win_ring: int = 0,
                      tuning: DecodeTuning | None = None, target_programs: int | None = None,
                      cmp_tile: int | None = None,
                      launch_info: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NSA for queries at absolute positions pos0 .. pos0+Tq-1 against cache buffers (no checks of
    lengths here: nsa.ops.nsa_decode validates the int form).

    q [B,Tq,HQ,dk], gates [B,Tq,HQ,3]; k_cmp/v_cmp [B,Ncap,H,*] (compressed tokens; those visible at
    t are read), k_slc/v_slc [B,Scap,H,*] (raw tokens 0..t), k_win/v_win [B,Swcap,H,*]: row r holds
    absolute position win_pos0 + r, or, when win_ring > 0, position p sits at row p % win_ring
    (a ring of win_ring >= w + Tq - 1 rows; win_pos0 is then ignored). pos0 / win_pos0: Python
    ints, or int device tensors of shape [1] or [B] (then nothing on the host depends on them: a
    CUDA graph of this call replays at any position that fits the buffers). scale: the softmax
    scale. tuning: the launch knobs (None: the preset of q's device; tests shrink them with
    DecodeTuning.with_knobs); target_programs / cmp_tile: shorthands setting the knobs' cmp_per_sm and
    sw_per_sm (from programs in all) / cmp_tile. launch_info: a dict that receives kernel name ->
    compiled kernel (register / spill diagnostics). Returns (o [B,Tq,HQ,dv] in q.dtype,
    block_idx [B,Tq,H,n_sel] int64 ascending, -1 padded).
    """
    la = decode_launcher(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d, l_sel=l_sel, n_sel=n_sel,
                         w=w, win_ring=win_ring, tuning=tuning, target_programs=target_programs, cmp_tile=cmp_tile,
                         pos_ptr=isinstance(pos0, torch.Tensor))
    return la(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, pos0, win_pos0, scale, launch_info)
