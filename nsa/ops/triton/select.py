"""Selection branch: group-centric sparse attention over the selected blocks (fwd + bwd).

The forward (function.py) chooses blocks with scores.select_blocks (fused scores + top-n; the two-step
scores_unfused.block_scores + select_topn is its independent cross-check).

Attention.  One program per (token, b, kv head) with the G query heads as rows (padded to >= 16 for
tl.dot), looping over the n_sel selected blocks with an online softmax; causal mask inside the block.
Backward: dq per (token, kv head); dK/dV without atomics by inverting the selection on device
(sort of (b, h, block) keys), then one program per (block, chunk of <= CH queries) loops over the
queries that selected it; chunks > 0 write fp32 partials that a last kernel adds in chunk order.
With a query offset (QOFF, the launchers' q_off) query row t sits at position t + QOFF of the keys
(a context-parallel chunk): every causal test uses that position, the dK/dV rows are the keys'.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import LOG2E
from ..route import WalkPlan, walk_plan
from ..tuning import SelectTuning
from ._utils import dot_precision, next_pow2, row_block
from .attn import _load_rows_bwd, load_group, online_softmax_step
from .inversion import invert_selection
from .walk_gluon import gwalk_dkdv


# ----------------------------------------------------------------------------------------------
# selected-block attention


@triton.jit
def _slc_fwd_kernel(Q, K, V, BI, O, LSE, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                    sob, sot, soh, sbb, sbt, sbh, T, H, QOFF, scale_log2,
                    G: tl.constexpr, GR: tl.constexpr, LSEL: tl.constexpr, NSEL: tl.constexpr,
                    DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                    BS: tl.constexpr, DOT_PREC: tl.constexpr):
    t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    t64 = t.to(tl.int64)
    rows = tl.arange(0, GR)
    row_ok = rows < G
    hq = (h * G + rows).to(tl.int64)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q = load_group(Q, b, t64, hq, row_ok, offs_dk, sqb, sqt, sqh, DK)      # [GR, BDK]
    m_i = tl.full([GR], float("-inf"), tl.float32)
    l_i = tl.zeros([GR], tl.float32)
    acc = tl.zeros([GR, BDV], tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    bi_base = BI + b * sbb + t64 * sbt + h * sbh
    NSUB: tl.constexpr = (LSEL + BS - 1) // BS          # key tiles per selected block
    for it in range(NSEL * NSUB):                        # one flat loop: one tile per pipeline stage
        j = tl.load(bi_base + it // NSUB)
        kk = (it % NSUB) * BS + tl.arange(0, BS)
        kp = j * LSEL + kk                                                  # [BS] int64 positions
        k_ok = (kp >= 0) & (kk < LSEL) & (kp <= t + QOFF)   # j = -1 gives kp < 0; row t at position t + QOFF
        k = tl.load(k_base + kp[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        s = tl.where(k_ok[None, :], s, float("-inf"))
        v = tl.load(v_base + kp[:, None] * svt + offs_dv[None, :],
                    mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(O + b * sob + t64 * sot + hq[:, None] * soh + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + (b * T + t64) * (H * G) + hq, lse, mask=row_ok)


@triton.jit
def _slc_rows_bwd(Q, DO, LSE, DELTA, GATE, b, t64, hq, row_ok, offs_dk, offs_dv,
                  sqb, sqt, sqh, sdb, sdt, sdh, sgt, T, HQ,
                  DK: tl.constexpr, DV: tl.constexpr, HAS_GATE: tl.constexpr):
    q = load_group(Q, b, t64, hq, row_ok, offs_dk, sqb, sqt, sqh, DK)
    do = load_group(DO, b, t64, hq, row_ok, offs_dv, sdb, sdt, sdh, DV)
    ridx = (b * T + t64) * HQ + hq
    lse = tl.load(LSE + ridx, mask=row_ok, other=0.0) * 1.4426950408889634
    delta = tl.load(DELTA + ridx, mask=row_ok, other=0.0)
    if HAS_GATE:   # the branch's dO is gate * dO: applied to p (dS = g p (dP - delta)), not to dO
        gate = tl.load(GATE + ridx * sgt, mask=row_ok, other=0.0).to(tl.float32)
    else:
        gate = tl.full([q.shape[0]], 1.0, tl.float32)
    return q, do, lse, delta, gate


@triton.jit
def _slc_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, GATE, BI, DQ, DQ_IN,
                       sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, sgt, sbb, sbt, sbh,
                       T, H, QOFF, scale_log2, scale,
                       G: tl.constexpr, GR: tl.constexpr, LSEL: tl.constexpr, NSEL: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr,
                       BS: tl.constexpr, HAS_GATE: tl.constexpr, ACC_DQ: tl.constexpr,
                       DOT_PREC: tl.constexpr):
    t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    t64 = t.to(tl.int64)
    rows = tl.arange(0, GR)
    row_ok = rows < G
    hq = (h * G + rows).to(tl.int64)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    q, do, lse, delta, gate = _slc_rows_bwd(Q, DO, LSE, DELTA, GATE, b, t64, hq, row_ok, offs_dk, offs_dv,
                                            sqb, sqt, sqh, sdb, sdt, sdh, sgt, T, H * G, DK, DV, HAS_GATE)
    dq = tl.zeros([GR, BDK], tl.float32)
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    bi_base = BI + b * sbb + t64 * sbt + h * sbh
    NSUB: tl.constexpr = (LSEL + BS - 1) // BS          # key tiles per selected block
    for it in range(NSEL * NSUB):                        # one flat loop: one tile per pipeline stage
        j = tl.load(bi_base + it // NSUB)
        kk = (it % NSUB) * BS + tl.arange(0, BS)
        kp = j * LSEL + kk
        k_ok = (kp >= 0) & (kk < LSEL) & (kp <= t + QOFF)   # j = -1 gives kp < 0; row t at position t + QOFF
        k = tl.load(k_base + kp[:, None] * skt + offs_dk[None, :],
                    mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
        v = tl.load(v_base + kp[:, None] * svt + offs_dv[None, :],
                    mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        p = tl.where(k_ok[None, :], tl.exp2(s - lse[:, None]), 0.0) * gate[:, None]   # g * p
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
    dq = dq * scale
    dq_off = ((b * T + t64) * (H * G) + hq)[:, None] * DK + offs_dk[None, :]   # contiguous dq
    dq_mask = row_ok[:, None] & (offs_dk[None, :] < DK)
    if ACC_DQ:
        dq += tl.load(DQ_IN + dq_off, mask=dq_mask, other=0.0)
    tl.store(DQ + dq_off, dq.to(DQ.dtype.element_ty), mask=dq_mask)


@triton.jit
def work_item(WSEG, WCHUNK, SEGOFF, NSEG, NSB, H, CH: tl.constexpr):
    """This program's work item of an inverted selection (invert_selection): segment seg = (b, h, block
    j) and chunk c of its list, whose entries start..end-1 it walks (none when ok is false: a spare
    item past the last one). Returns (seg, chunk, ok, j, b, h, start, end); start / end are int32 (the
    walks' per-row list positions are then int32 too: segment_lists checks the pair count fits)."""
    w = tl.program_id(0)
    seg = tl.load(WSEG + w)
    chunk = tl.load(WCHUNK + w)
    ok = seg < NSEG
    seg = tl.where(ok, seg, 0)
    j = seg % NSB
    bh = seg // NSB
    start = tl.load(SEGOFF + seg) + chunk * CH
    end = tl.where(ok, tl.minimum(tl.load(SEGOFF + seg + 1), start + CH), start)
    return seg, chunk, ok, j, bh // H, bh % H, start.to(tl.int32), end.to(tl.int32)


@triton.jit
def block_kv(K, V, b, h, j, T, skb, skt, skh, svb, svt, svh, LSEL: tl.constexpr, BS: tl.constexpr,
             DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr, BDV: tl.constexpr):
    """Selection block j of (b, kv head h): K [BS, BDK] and V [BS, BDV] (rows past the block or T are 0),
    with its key offsets kk, positions kp (int64) and their mask k_ok, and the head-dim offsets."""
    kk = tl.arange(0, BS)
    kp = j * LSEL + kk
    k_ok = (kk < LSEL) & (kp < T)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    k = tl.load(K + b * skb + h * skh + kp[:, None] * skt + offs_dk[None, :],
                mask=k_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
    v = tl.load(V + b * svb + h * svh + kp[:, None] * svt + offs_dv[None, :],
                mask=k_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return kk, kp, k_ok, offs_dk, offs_dv, k, v


@triton.jit
def walk_rows(TOKS, idx, end, rows, G: tl.constexpr, GP: tl.constexpr, QB: tl.constexpr):
    """One step of a block's token list from entry idx: row r is head r % GP of entry idx + r // GP,
    for QB entries (GP = G packs the heads densely, e.g. 10 tokens x 6 heads in 64 rows; rows from
    QB * GP on belong to the next step). Returns (entry [ROWS], its token [ROWS] int64, row valid:
    entry < end, row < QB * GP and head < G)."""
    qidx = idx + rows // GP
    q_ok = (qidx < end) & (rows < QB * GP)
    t64 = tl.load(TOKS + qidx, mask=q_ok, other=0)
    return qidx, t64, q_ok & (rows % GP < G)


@triton.jit
def walk_ids(TOKS, start, end, WIN: tl.constexpr):
    """The token ids of list entries start .. end-1 (end - start <= WIN), loaded once into registers
    [WIN] int32 (walk_rows_in then takes each step's from there, no dependent global load per step).
    The block-order forward's pieces fit; the dK/dV walk's 1024-entry lists would need windows, whose
    pipeline restarts were slower than its token-id prefetch."""
    offs = start + tl.arange(0, WIN)
    return tl.load(TOKS + offs, mask=offs < end, other=0).to(tl.int32)


@triton.jit
def walk_rows_in(ids, start, idx, end, rows, G: tl.constexpr, GP: tl.constexpr, QB: tl.constexpr,
                 WIN: tl.constexpr):
    """walk_rows with the token ids from walk_ids' registers (ids of entries start..): the step's gathers
    then depend on no load inside the loop, so Triton's pipeliner can issue them a step ahead."""
    qidx = idx + rows // GP
    q_ok = (qidx < end) & (rows < QB * GP)
    t = tl.gather(ids, tl.minimum(qidx - start, WIN - 1), 0)
    return qidx, t.to(tl.int64), q_ok & (rows % GP < G)


@triton.jit
def walk_limit(t64, row_ok, j0, LSEL: tl.constexpr):
    """[ROWS] int32: the last key offset in the block (starting at key j0) that each row's token sees,
    -1 for rows past the list. A key kk < BS is visible iff kk <= this: it folds the causal mask, the
    block's end (kk < LSEL) and its end at T (t < T) into one int32 compare per element, where int64
    positions held per row and per key of an MMA tile took registers the walks spilled for."""
    return tl.where(row_ok, tl.minimum(t64 - j0, LSEL - 1), -1).to(tl.int32)


@triton.jit
def _store_dq_pairs(DQP, dqp, qidx, row_ok, g, offs_dk, G: tl.constexpr, DK: tl.constexpr):
    pr = qidx.to(tl.int64) * G + g                                          # partial row of (pair, head)
    tl.store(DQP + pr[:, None] * DK + offs_dk[None, :], dqp.to(DQP.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk[None, :] < DK))


@triton.jit
def _dkdv_step(dk, dv, k, v, kk, j0, q, do, lse, delta, gate, qidx, t64, row_ok, g, offs_dk, DQP,
               scale_log2, scale, G: tl.constexpr, LSEL: tl.constexpr, DK: tl.constexpr,
               DOT_PREC: tl.constexpr, DQ_PAIRS: tl.constexpr):
    """dK/dV accumulation of one step (block K/V [BS, *] against ROWS gathered rows); with DQ_PAIRS also
    the rows' dq partials [ROWS, dk] stored at their pair positions."""
    if q.shape[0] >= 64:
        # rows on the MMA's M side: per-row vectors (lse, delta, gate, limit) then cost ROWS / 32 registers
        # per thread, where as columns of a [BS, ROWS] tile each cost ROWS / 4 (the 128-row walk spilled)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2   # [ROWS, BS]
        vis = kk[None, :] <= walk_limit(t64, row_ok, j0, LSEL)[:, None]
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0) * gate[:, None]  # g * p
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PREC)   # [BS, BDV]
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)              # [ROWS, BS]
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dk += tl.dot(tl.trans(ds), q, input_precision=DOT_PREC)             # [BS, BDK]
        if DQ_PAIRS:
            dqp = tl.dot(ds, k, input_precision=DOT_PREC) * scale           # [ROWS, BDK]
            _store_dq_pairs(DQP, dqp, qidx, row_ok, g, offs_dk, G, DK)
    else:
        # fewer than 64 rows (G=16's 32-row steps): the keys take the M side, where Hopper's wgmma wants
        # 64 (with rows there these products would fall back to the older MMA)
        sT = tl.dot(k, tl.trans(q), input_precision=DOT_PREC) * scale_log2  # [BS, ROWS]
        vis = kk[:, None] <= walk_limit(t64, row_ok, j0, LSEL)[None, :]
        pT = tl.where(vis, tl.exp2(sT - lse[None, :]), 0.0) * gate[None, :]
        dv += tl.dot(pT.to(do.dtype), do, input_precision=DOT_PREC)
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk += tl.dot(dsT, q, input_precision=DOT_PREC)
        if DQ_PAIRS:
            dqp = tl.dot(tl.trans(dsT), k, input_precision=DOT_PREC) * scale   # [ROWS, BDK]
            _store_dq_pairs(DQP, dqp, qidx, row_ok, g, offs_dk, G, DK)
    return dk, dv


@triton.jit
def _slc_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, GATE, TOKS, SEGOFF, WSEG, WCHUNK, XOFF,
                         DKO, DVO, XDK, XDV, DQP,
                         sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdb, sdt, sdh, sgt,
                         T, TK, H, NSB, NSEG, QOFF, scale_log2, scale,
                         G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, LSEL: tl.constexpr,
                         CH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                         BDV: tl.constexpr, BS: tl.constexpr, HAS_GATE: tl.constexpr, DOT_PREC: tl.constexpr,
                         DQ_PAIRS: tl.constexpr, PREFETCH: tl.constexpr,
                         LOOP_STAGES: tl.constexpr):
    """One program per work item (segment = (b, h, block j), chunk c of its query list). Each step
    takes ROWS // GP queries of the list at once: row r is head r % GP of query r // GP. DQ_PAIRS:
    also each (query, block) pair's dq partial [G, dk] at the pair's list position (DQP; summed per
    token by select_block.pair_dq). T query rows at positions QOFF.., TK keys (TK = T, QOFF = 0 without an
    offset): the token ids of the lists are rows, the dK/dV rows are keys.
    PREFETCH: each step's token ids are loaded two steps before (Triton pipelines the gathers they address
    one step ahead, and without this each of them first waits for its token-id load). LOOP_STAGES > 0:
    the step loop is tl.range(num_stages=LOOP_STAGES), which pipelines every load of a step (token ids,
    lse / delta / gate, the gathers), not only the dot operands as the kernel's num_stages does."""
    seg, chunk, ok, j, b, h, start, end = work_item(WSEG, WCHUNK, SEGOFF, NSEG, NSB, H, CH)
    kk, _, _, offs_dk, offs_dv, k, v = block_kv(K, V, b, h, j, TK, skb, skt, skh, svb, svt, svh, LSEL, BS,
                                                DK, DV, BDK, BDV)
    j0 = j * LSEL - QOFF   # the block's first key in query-row units (row t sits at position t + QOFF)
    QB: tl.constexpr = ROWS // GP                                           # queries per step
    rows = tl.arange(0, ROWS)
    g = rows % GP
    hq = (h * G + g).to(tl.int64)
    dk = tl.zeros([BS, BDK], tl.float32)
    dv = tl.zeros([BS, BDV], tl.float32)
    if PREFETCH:   # token ids two steps ahead: the pipeliner's gathers for the next step never wait on them
        qi_a, t_a, ok_a = walk_rows(TOKS, start, end, rows, G, GP, QB)
        qi_b, t_b, ok_b = walk_rows(TOKS, start + QB, end, rows, G, GP, QB)
        for idx in range(start, end, QB):
            qi_c, t_c, ok_c = walk_rows(TOKS, idx + 2 * QB, end, rows, G, GP, QB)
            q, do, lse, delta, gate = _load_rows_bwd(Q, DO, LSE, DELTA, GATE, b, t_a, hq, ok_a, offs_dk, offs_dv,
                                                     sqb, sqt, sqh, sdb, sdt, sdh, T, H * G, sgt, DK, DV, HAS_GATE)
            dk, dv = _dkdv_step(dk, dv, k, v, kk, j0, q, do, lse, delta, gate, qi_a, t_a, ok_a, g, offs_dk,
                                DQP, scale_log2, scale, G, LSEL, DK, DOT_PREC, DQ_PAIRS)
            qi_a, t_a, ok_a = qi_b, t_b, ok_b
            qi_b, t_b, ok_b = qi_c, t_c, ok_c
    else:   # LOOP_STAGES 0: no loop attribute, the same code as a plain range (sm_90 PTX identical)
        for idx in tl.range(start, end, QB, num_stages=LOOP_STAGES if LOOP_STAGES > 0 else None):
            qidx, t64, row_ok = walk_rows(TOKS, idx, end, rows, G, GP, QB)
            q, do, lse, delta, gate = _load_rows_bwd(Q, DO, LSE, DELTA, GATE, b, t64, hq, row_ok, offs_dk, offs_dv,
                                                     sqb, sqt, sqh, sdb, sdt, sdh, T, H * G, sgt, DK, DV, HAS_GATE)
            dk, dv = _dkdv_step(dk, dv, k, v, kk, j0, q, do, lse, delta, gate, qidx, t64, row_ok, g, offs_dk,
                                DQP, scale_log2, scale, G, LSEL, DK, DOT_PREC, DQ_PAIRS)
    dk = dk * scale
    # scalar conditions as vectors (Triton's interpreter mishandles scalar-bool & vector-bool masks)
    # the block's rows from scalars (j, T) rather than block_kv's int64 kp / k_ok vectors; on sm_90 this
    # compiled to the same registers, it only keeps the loop free of them in the source
    first = (tl.zeros([BS], tl.int32) + (ok & (chunk == 0)).to(tl.int32)) > 0
    first = first & (kk < tl.minimum(TK - j * LSEL, LSEL))
    o_row = ((b * TK + j * LSEL) * H + h) + kk.to(tl.int64) * H             # rows of [B,TK,H,*] fp32
    tl.store(DKO + o_row[:, None] * DK + offs_dk[None, :], dk,
             mask=first[:, None] & (offs_dk[None, :] < DK))
    tl.store(DVO + o_row[:, None] * DV + offs_dv[None, :], dv,
             mask=first[:, None] & (offs_dv[None, :] < DV))
    extra = (tl.zeros([BS], tl.int32) + (ok & (chunk > 0)).to(tl.int32)) > 0
    slot = tl.load(XOFF + seg) + chunk - 1
    x_row = (tl.where(extra, slot, 0) * LSEL + kk).to(tl.int64)
    x_ok = extra & (kk < LSEL)
    tl.store(XDK + x_row[:, None] * DK + offs_dk[None, :], dk,
             mask=x_ok[:, None] & (offs_dk[None, :] < DK))
    tl.store(XDV + x_row[:, None] * DV + offs_dv[None, :], dv,
             mask=x_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _slc_reduce_kernel(DKO, DVO, XDK, XDV, DK_OUT, DV_OUT, NCH, XOFF, T, H, NSB,
                       LSEL: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       BDK: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr):
    """dK/dV of one segment's LSEL keys in the output dtype: chunk 0's fp32 result plus the fp32
    partials of chunks 1.., added in chunk order (one pass: no separate dtype conversion)."""
    seg = tl.program_id(0)
    j = seg % NSB
    bh = seg // NSB
    b = (bh // H).to(tl.int64)
    h = bh % H
    nch = tl.load(NCH + seg)
    xo = tl.load(XOFF + seg)
    kk = tl.arange(0, BS)
    kp = j * LSEL + kk
    k_ok = (kk < LSEL) & (kp < T)
    offs_dk = tl.arange(0, BDK)
    offs_dv = tl.arange(0, BDV)
    o_row = ((b * T + kp) * H + h)
    mk = k_ok[:, None] & (offs_dk[None, :] < DK)
    mv = k_ok[:, None] & (offs_dv[None, :] < DV)
    acc_k = tl.load(DKO + o_row[:, None] * DK + offs_dk[None, :], mask=mk, other=0.0)
    acc_v = tl.load(DVO + o_row[:, None] * DV + offs_dv[None, :], mask=mv, other=0.0)
    for c in range(1, nch):
        x_row = ((xo + c - 1) * LSEL + kk).to(tl.int64)
        acc_k += tl.load(XDK + x_row[:, None] * DK + offs_dk[None, :], mask=mk, other=0.0)
        acc_v += tl.load(XDV + x_row[:, None] * DV + offs_dv[None, :], mask=mv, other=0.0)
    tl.store(DK_OUT + o_row[:, None] * DK + offs_dk[None, :], acc_k.to(DK_OUT.dtype.element_ty), mask=mk)
    tl.store(DV_OUT + o_row[:, None] * DV + offs_dv[None, :], acc_v.to(DV_OUT.dtype.element_ty), mask=mv)


# ----------------------------------------------------------------------------------------------
# launchers


def _slc_meta(q: torch.Tensor, G: int, dk: int, dv: int, l_sel: int) -> dict:
    bdk, bdv = max(16, next_pow2(dk)), max(16, next_pow2(dv))
    return dict(G=G, GR=row_block(next_pow2(G), 16), LSEL=l_sel, DK=dk, DV=dv, BDK=bdk, BDV=bdv,
                DOT_PREC=dot_precision(q.dtype, q.is_cuda))


def slc_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, *,
            l_sel: int, scale: float, tuning: SelectTuning | None = None,
            out: tuple[torch.Tensor, torch.Tensor] | None = None, q_off: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B,T,HQ,dk], k/v [B,TK,H,*], block_idx [B,T,H,n_sel] -> (o [B,T,HQ,dv], lse fp32 [B,T,HQ]).
    tuning: launch parameters (None: the preset of q's device). out: (o, lse) to write (contiguous).
    q_off: query row t sits at position t + q_off (TK >= q_off + T; 0: TK = T)."""
    tn = tuning or SelectTuning()
    B, T, HQ, dk = q.shape
    H, dv, n_sel = k.shape[2], v.shape[3], block_idx.shape[3]
    o, lse = out if out is not None else (torch.empty(B, T, HQ, dv, device=q.device, dtype=q.dtype),
                                          torch.empty(B, T, HQ, device=q.device, dtype=torch.float32))
    meta = _slc_meta(q, HQ // H, dk, dv, l_sel)
    _slc_fwd_kernel[(T, B * H)](
        q, k, v, block_idx, o, lse, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2), T, H, q_off, scale * LOG2E,
        NSEL=n_sel, BS=min(max(16, next_pow2(l_sel)), tn.fwd_keys), num_stages=tn.fwd_stages,
        num_warps=tn.fwd_warps, **meta)
    return o, lse


def _bwd_args(q, k, v, do, lse, delta, gate):
    """(gate argument, lse, delta contiguous, stride tuple) shared by the selection backward kernels."""
    has_gate = gate is not None
    sgt = gate.stride(2) if has_gate else 1
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2), sgt)
    return (gate if has_gate else lse), lse.contiguous(), delta.contiguous(), strides


def dq_buffer(q: torch.Tensor, dq_in: torch.Tensor | None, dq_dtype: torch.dtype | None) -> torch.Tensor:
    """Where a dq kernel writes: dq_in itself when accumulating in fp32 (each element is read and
    written by the same program), else a new [B,T,HQ,dk] tensor of dq_dtype (default q's)."""
    dq_dtype = dq_dtype or q.dtype
    return dq_in if dq_in is not None and dq_dtype == torch.float32 else \
        torch.empty(q.shape, device=q.device, dtype=dq_dtype)


def slc_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, do: torch.Tensor,
           lse: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor | None, *, l_sel: int, scale: float,
           dq_in: torch.Tensor | None = None, dq_dtype: torch.dtype | None = None,
           tuning: SelectTuning | None = None, dq_out: torch.Tensor | None = None, q_off: int = 0) -> torch.Tensor:
    """dq of slc_fwd (plus dq_in), per (token, kv head) program; dq_out: the buffer to write
    (dq_buffer's); q_off as in slc_fwd."""
    tn = tuning or SelectTuning()
    B, T, HQ, dk = q.shape
    H, dv, n_sel = k.shape[2], v.shape[3], block_idx.shape[3]
    g_arg, lse, delta, strides = _bwd_args(q, k, v, do, lse, delta, gate)
    dq = dq_out if dq_out is not None else dq_buffer(q, dq_in, dq_dtype)
    _slc_bwd_dq_kernel[(T, B * H)](
        q, k, v, do, lse, delta, g_arg, block_idx, dq, dq if dq_in is None else dq_in, *strides,
        block_idx.stride(0), block_idx.stride(1), block_idx.stride(2), T, H, q_off, scale * LOG2E, scale,
        NSEL=n_sel, BS=min(max(16, next_pow2(l_sel)), tn.dq_keys), HAS_GATE=gate is not None,
        ACC_DQ=dq_in is not None, num_stages=tn.dq_stages, num_warps=tn.dq_warps,
        **_slc_meta(q, HQ // H, dk, dv, l_sel))
    return dq


def slc_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, do: torch.Tensor,
             lse: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor | None, *, l_sel: int, scale: float,
             chunk: int = 1024, tuning: SelectTuning | None = None,
             inv: dict | None = None, dq_pairs: torch.Tensor | None = None,
             walk: WalkPlan | None = None, q_off: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of slc_fwd: per selected block, a walk over the tokens that selected it (chunks of
    <= chunk, fp32 partials reduced in a fixed order: deterministic, no atomics). inv: the forward's
    invert_selection(block_idx, l_sel, chunk) when it made one. dq_pairs [P*G, dk]: also write every
    (token, block) pair's dq partial there (select_block.pair_dq sums them; needs inv). walk: the plan's
    (nsa/ops/plan.py: rows, Gluon or Triton, prefetch, loop stages); None: the Triton walk under tuning.
    q_off: as in slc_fwd (the Triton walk only: the plan gives such calls no Gluon walk); dK/dV are [B,TK,H,*]."""
    tn = tuning or SelectTuning()
    B, T, HQ, dk = q.shape
    TK, H, dv = k.shape[1], k.shape[2], v.shape[3]
    meta = _slc_meta(q, HQ // H, dk, dv, l_sel)
    g_arg, lse, delta, strides = _bwd_args(q, k, v, do, lse, delta, gate)
    if inv is None or inv["chunk"] != chunk:
        inv = invert_selection(block_idx, l_sel, chunk, n_keys=TK)
    dk32 = torch.empty(B, TK, H, dk, device=q.device, dtype=torch.float32)
    dv32 = torch.empty(B, TK, H, dv, device=q.device, dtype=torch.float32)
    xdk = torch.empty(inv["n_slots"], l_sel, dk, device=q.device, dtype=torch.float32)
    xdv = torch.empty(inv["n_slots"], l_sel, dv, device=q.device, dtype=torch.float32)
    bs = max(16, next_pow2(l_sel))
    wk = walk if walk is not None and walk.dq_pairs == (dq_pairs is not None) else \
        walk_plan(tn, HQ // H, max(dk, dv) > 128, dq_pairs is not None)
    if not (wk.gluon and gwalk_dkdv(q, k, v, do, lse, delta, g_arg, strides[-1], inv, dk32, dv32, xdk, xdv,
                                    chunk=chunk, scale=scale, stages=wk.gluon, has_gate=gate is not None,
                                    dq_pairs=dq_pairs)):
        _slc_bwd_dkdv_kernel[(inv["w_max"],)](
            q, k, v, do, lse, delta, g_arg, inv["toks"], inv["segoff"], inv["wseg"], inv["wchunk"], inv["xoff"],
            dk32, dv32, xdk, xdv, dk32 if dq_pairs is None else dq_pairs, *strides, T, TK, H, inv["nsb"],
            inv["nseg"], q_off, scale * LOG2E, scale, DQ_PAIRS=dq_pairs is not None,
            PREFETCH=wk.prefetch, LOOP_STAGES=wk.loop_stages,
            CH=chunk, BS=bs, HAS_GATE=gate is not None, num_stages=tn.dkdv_stages, num_warps=tn.dkdv_warps,
            GP=wk.group, ROWS=wk.rows,
            **{k: v for k, v in meta.items() if k != "GR"})
    return reduce_dkdv(dk32, dv32, xdk, xdv, inv, k.dtype, v.dtype, l_sel=l_sel, bdk=meta["BDK"], bdv=meta["BDV"])


def reduce_dkdv(dk32: torch.Tensor, dv32: torch.Tensor, xdk: torch.Tensor, xdv: torch.Tensor, inv: dict,
                k_dtype: torch.dtype, v_dtype: torch.dtype, *, l_sel: int, bdk: int, bdv: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dK, dV) [B,T,H,*] in k's / v's dtype from a dK/dV walk's fp32 chunk-0 results dk32/dv32 and its
    fp32 partials of later chunks xdk/xdv (segments and chunks of inv)."""
    B, T, H, dk = dk32.shape
    dks = torch.empty(B, T, H, dk, device=dk32.device, dtype=k_dtype)
    dvs = torch.empty(B, T, H, dv32.shape[3], device=dk32.device, dtype=v_dtype)
    _slc_reduce_kernel[(inv["nseg"],)](dk32, dv32, xdk, xdv, dks, dvs, inv["nch"], inv["xoff"], T, H, inv["nsb"],
                                       LSEL=l_sel, DK=dk, DV=dv32.shape[3], BDK=bdk, BDV=bdv,
                                       BS=max(16, next_pow2(l_sel)), num_warps=8)
    return dks, dvs


def slc_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, do: torch.Tensor,
            lse: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor | None, *, l_sel: int, scale: float,
            chunk: int = 1024, dq_in: torch.Tensor | None = None,
            dq_dtype: torch.dtype | None = None,
            tuning: SelectTuning | None = None,
            inv: dict | None = None, walk: WalkPlan | None = None,
            q_off: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of slc_fwd (same conventions for do/delta/gate/dq_in as attn.attn_bwd; inv, walk and q_off as
    in slc_dkdv)."""
    kw = dict(l_sel=l_sel, scale=scale, tuning=tuning, q_off=q_off)
    dq = slc_dq(q, k, v, block_idx, do, lse, delta, gate, dq_in=dq_in, dq_dtype=dq_dtype, **kw)
    return (dq, *slc_dkdv(q, k, v, block_idx, do, lse, delta, gate, chunk=chunk, inv=inv, walk=walk, **kw))
