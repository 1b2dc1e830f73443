"""Selection forward one selected block at a time: pair partials merged per token.

The per-token forward (select.py) loads each selected block's K/V for the G query rows of one token:
with few heads per KV head (the production model's G=6, padded to 16 MMA rows) that is ~16 KB of K/V
per (token, block) pair for 6 useful rows, and L2 bandwidth bounds it. Here the loop order is turned
around, as in the dK/dV kernel: one program per (b, kv head, block j, chunk of <= CH of the tokens that
selected j) (select.invert_selection) loads the block's K/V once and walks its tokens ROWS // GP at a
time (row r = head r % GP of token r // GP, so a step fills a full MMA tile). Each (token, block) pair
gets its softmax partial over that block: o normalised [G, dv] and lse (log2 domain), stored at the
pair's position in the sorted pair list. A second kernel merges every token's n_sel partials (its
slots' positions come from the inverse permutation, `rank`) into o [B,T,HQ,dv] and lse (natural log),
the same quantities slc_fwd writes; the backward is unchanged.

Traffic per pair: the q rows in (G*dk) and the partial out and back ((G*dv + G) * partial bytes), against
l_sel*(dk+dv) K/V elements per pair in the per-token kernel. Partials are fp32, q's dtype ("input": for
bf16 that rounds each block's o to bf16 before the merge) or "fp16": o / max|v| in fp16, which the merge
scales back (o is a convex mix of v rows, so the stored values lie in [-1, 1]).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import LOG2E
from ..route import PairPlan, pair_plan
from ..tuning import SelectTuning
from ._utils import dot_precision, next_pow2, reg_cap
from .inversion import work_items
from .qsum import QAdd, add_q_terms, q_add_args
from .select import block_kv, walk_ids, walk_limit, walk_rows, walk_rows_in, work_item


@triton.jit
def _pair_fwd_kernel(Q, K, V, TOKS, SEGOFF, WSEG, WCHUNK, OP, LP, VS,
                     sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                     T, H, NSB, NSEG, scale_log2,
                     G: tl.constexpr, GP: tl.constexpr, ROWS: tl.constexpr, LSEL: tl.constexpr,
                     CH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BDK: tl.constexpr,
                     BDV: tl.constexpr, BS: tl.constexpr, DOT_PREC: tl.constexpr,
                     IDS_IN_REGS: tl.constexpr, WIN: tl.constexpr, SCALED: tl.constexpr):
    """One work item (segment = (b, h, block j), chunk c of its token list): partials of its pairs."""
    _, _, _, j, b, h, start, end = work_item(WSEG, WCHUNK, SEGOFF, NSEG, NSB, H, CH)
    kk, _, _, offs_dk, offs_dv, k, v = block_kv(K, V, b, h, j, T, skb, skt, skh, svb, svt, svh, LSEL, BS,
                                                DK, DV, BDK, BDV)
    QB: tl.constexpr = ROWS // GP                                           # tokens per step
    rows = tl.arange(0, ROWS)
    g = rows % GP
    hq = (h * G + g).to(tl.int64)
    inv_vs = 1.0 / tl.load(VS) if SCALED else 1.0       # fp16 partials hold o / max|v| (in [-1, 1])
    # no token-id prefetch here (select.prefetch is the dK/dV walk's): Triton pipelines this q gather one
    # step ahead, carried token ids stop that, and it measured slower (bench/RESULTS.md, Tried)
    if IDS_IN_REGS:   # short pieces: their token ids in registers, so the q gathers pipeline
        ids = walk_ids(TOKS, start, end, WIN)
        for idx in range(start, end, QB):
            qidx, t64, row_ok = walk_rows_in(ids, start, idx, end, rows, G, GP, QB, WIN)
            q = _gather_q(Q, b, t64, row_ok, hq, offs_dk, sqb, sqt, sqh, DK)
            _pair_step(q, qidx, t64, row_ok, k, v, kk, j * LSEL, g, offs_dv, OP, LP, scale_log2, inv_vs, G, LSEL,
                       DV, DOT_PREC)
    else:
        for idx in range(start, end, QB):
            qidx, t64, row_ok = walk_rows(TOKS, idx, end, rows, G, GP, QB)     # qidx: pair positions
            q = _gather_q(Q, b, t64, row_ok, hq, offs_dk, sqb, sqt, sqh, DK)
            _pair_step(q, qidx, t64, row_ok, k, v, kk, j * LSEL, g, offs_dv, OP, LP, scale_log2, inv_vs, G, LSEL,
                       DV, DOT_PREC)


@triton.jit
def _gather_q(Q, b, t64, row_ok, hq, offs_dk, sqb, sqt, sqh, DK: tl.constexpr):
    return tl.load(Q + b * sqb + t64[:, None] * sqt + hq[:, None] * sqh + offs_dk[None, :],
                   mask=row_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)


@triton.jit
def _pair_step(q, qidx, t64, row_ok, k, v, kk, j0, g, offs_dv, OP, LP, scale_log2, inv_vs, G: tl.constexpr,
               LSEL: tl.constexpr, DV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Softmax partials of one step's rows (q [ROWS, BDK], entries qidx = pair positions) over the block."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2      # [ROWS, BS]
    vis = kk[None, :] <= walk_limit(t64, row_ok, j0, LSEL)[:, None]
    s = tl.where(vis, s, float("-inf"))
    m = tl.max(s, 1)
    m = tl.where(m == float("-inf"), 0.0, m)        # padded rows (a selected block has a key <= t)
    p = tl.where(vis, tl.exp2(s - m[:, None]), 0.0)
    l_sum = tl.sum(p, 1)
    has = l_sum > 0.0
    o = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC) * (inv_vs / tl.where(has, l_sum, 1.0))[:, None]
    lse2 = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    pr = qidx.to(tl.int64) * G + g                                          # partial row of (pair, head)
    tl.store(OP + pr[:, None] * DV + offs_dv[None, :], o.to(OP.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LP + pr, lse2, mask=row_ok)


@triton.jit
def _token_rows(H, G: tl.constexpr, GR: tl.constexpr):
    """This program's (token t, b, kv head h) of a (T, B*H) grid and its G head rows, padded to GR."""
    t64 = tl.program_id(0).to(tl.int64)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    rows = tl.arange(0, GR)
    return t64, b, h, rows, rows < G, (h * G + rows).to(tl.int64)


@triton.jit
def _slot_rows(RANK, s, rows, row_ok, G: tl.constexpr):
    """(rows holding a partial, their partial rows) of slot s; RANK points at the token's slots."""
    r = tl.zeros(rows.shape, tl.int64) + tl.load(RANK + s)      # -1: an empty slot (vector form)
    ok = row_ok & (r >= 0)
    return ok, tl.where(ok, r, 0) * G + rows


@triton.jit
def _pair_merge_kernel(RANK, OP, LP, VS, O, LSE, srb, srt, srh, sob, sot, soh, T, H,
                       G: tl.constexpr, GR: tl.constexpr, NSEL: tl.constexpr, DV: tl.constexpr,
                       BDV: tl.constexpr, SCALED: tl.constexpr):
    """o, lse of one (token, kv head): the softmax merge of its slots' partials (slot order)."""
    t64, b, h, rows, row_ok, hq = _token_rows(H, G, GR)
    offs_dv = tl.arange(0, BDV)
    dv_ok = offs_dv[None, :] < DV
    m_i = tl.full([GR], float("-inf"), tl.float32)
    l_i = tl.zeros([GR], tl.float32)
    acc = tl.zeros([GR, BDV], tl.float32)
    r_base = RANK + b * srb + t64 * srt + h * srh
    for s in range(NSEL):
        ok, pr = _slot_rows(r_base, s, rows, row_ok, G)
        lp = tl.load(LP + pr, mask=ok, other=float("-inf"))
        op = tl.load(OP + pr[:, None] * DV + offs_dv[None, :], mask=ok[:, None] & dv_ok, other=0.0)
        m_new = tl.maximum(m_i, lp)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(lp - m_safe)
        acc = acc * alpha[:, None] + beta[:, None] * op.to(tl.float32)
        l_i = l_i * alpha + beta
        m_i = m_new
    has = l_i > 0.0
    o = acc * ((tl.load(VS) if SCALED else 1.0) / tl.where(has, l_i, 1.0))[:, None]
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634, float("-inf"))
    tl.store(O + b * sob + t64 * sot + hq[:, None] * soh + offs_dv[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None] & dv_ok)
    tl.store(LSE + (b * T + t64) * (H * G) + hq, lse, mask=row_ok)


@triton.jit
def _pair_dq_kernel(RANK, DQP, DQ, DQ_IN, GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s,
                    srb, srt, srh, T, H,
                    G: tl.constexpr, GR: tl.constexpr, NSEL: tl.constexpr, DK: tl.constexpr,
                    BDK: tl.constexpr, ACC_DQ: tl.constexpr, HAS_GC: tl.constexpr,
                    HAS_GW: tl.constexpr, GC_ACC: tl.constexpr, GW_ACC: tl.constexpr):
    """dq of one (token, kv head): its slots' pair partials summed in slot order (+ dq_in, + the flash
    branches' gradients of q: qsum.add_q_terms)."""
    t64, b, h, rows, row_ok, hq = _token_rows(H, G, GR)
    offs_dk = tl.arange(0, BDK)
    dk_ok = offs_dk[None, :] < DK
    acc = tl.zeros([GR, BDK], tl.float32)
    r_base = RANK + b * srb + t64 * srt + h * srh
    for s in range(NSEL):
        ok, pr = _slot_rows(r_base, s, rows, row_ok, G)
        acc += tl.load(DQP + pr[:, None] * DK + offs_dk[None, :], mask=ok[:, None] & dk_ok, other=0.0).to(tl.float32)
    off = ((b * T + t64) * (H * G) + hq)[:, None] * DK + offs_dk[None, :]   # contiguous dq
    if ACC_DQ:
        acc += tl.load(DQ_IN + off, mask=row_ok[:, None] & dk_ok, other=0.0)
    acc = add_q_terms(acc, GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s, b, t64 * (H * G) + hq, row_ok,
                      off, offs_dk, DK, HAS_GC, HAS_GW, GC_ACC, GW_ACC)
    tl.store(DQ + off, acc.to(DQ.dtype.element_ty), mask=row_ok[:, None] & dk_ok)


def pair_buffer(q: torch.Tensor, n_sel: int, H: int, dim: int, pairs: PairPlan, dq: bool = False) -> torch.Tensor:
    """[B*H*T*n_sel*G, dim] rows of pair partials (one per (pair, head)) in the plan's dtype (dq: the dK/dV
    walk's dq partials)."""
    B, T, HQ = q.shape[:3]
    kind = pairs.dq_dtype if dq else pairs.dtype
    pdt = {"fp32": torch.float32, "fp16": torch.float16}.get(kind, q.dtype)
    return torch.empty(max(1, B * T * n_sel * HQ), dim, device=q.device, dtype=pdt)


def pair_dq(q: torch.Tensor, dq_pairs: torch.Tensor, inv: dict, n_sel: int, H: int, *, dq: torch.Tensor,
            dq_in: torch.Tensor | None, add: QAdd | None = None) -> torch.Tensor:
    """dq [B,T,HQ,dk] (contiguous, written) = the sum of each token's pair partials (from the dK/dV
    kernel, select.slc_dkdv(dq_pairs=)) + dq_in + add's terms."""
    B, T, HQ, dk = q.shape
    G = HQ // H
    rank = inv["rank"]
    add_args, add_kw = q_add_args(add, dq)
    _pair_dq_kernel[(T, B * H)](rank, dq_pairs, dq, dq if dq_in is None else dq_in, *add_args,
                                rank.stride(0), rank.stride(2), rank.stride(1), T, H, G=G,
                                GR=max(16, next_pow2(G)), NSEL=n_sel, DK=dk, BDK=max(16, next_pow2(dk)),
                                ACC_DQ=dq_in is not None, num_warps=2, **add_kw)
    return dq


def slc_fwd_pairs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor, inv: dict, *,
                  l_sel: int, scale: float, chunk: int, tuning: SelectTuning | None = None,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  pairs: PairPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """slc_fwd's (o [B,T,HQ,dv], lse fp32 [B,T,HQ]) block by block. inv: invert_selection(block_idx,
    l_sel, chunk, ranks=True) (the dK/dV kernel reuses it); out as in slc_fwd. Programs walk
    tuning.pair_chunk entries of a block's list (0: the inversion's chunk): pairs are independent here,
    so short lists cost nothing but balance the long ones (block 0, each token's own block). pairs: the
    plan's partials (None: pair_plan under tuning)."""
    tn = tuning or SelectTuning()
    B, T, HQ, dk = q.shape
    H, dv, n_sel = k.shape[2], v.shape[3], block_idx.shape[3]
    G = HQ // H
    o, lse = out if out is not None else (torch.empty(B, T, HQ, dv, device=q.device, dtype=q.dtype),
                                          torch.empty(B, T, HQ, device=q.device, dtype=torch.float32))
    pairs = pairs or pair_plan(tn, G)
    op = pair_buffer(q, n_sel, H, dv, pairs)      # positions past the valid pairs are never written
    lp = torch.empty(op.shape[0], device=q.device, dtype=torch.float32)
    scaled = pairs.dtype == "fp16"
    # fp16 partials of o / max|v| (a device scalar from one reduction: no sync; clamped so an all-zero v,
    # whose o is 0, divides by no zero)
    vs = torch.linalg.vector_norm(v.detach(), float("inf"), dtype=torch.float32).clamp_min_(1e-30).reshape(1) \
        if scaled else lp   # max|v| of fp32 casts = the cast of max|v|: one kernel fewer than .float() after
    bdk, bdv, gp = max(16, next_pow2(dk)), max(16, next_pow2(dv)), next_pow2(G)
    prec = dot_precision(q.dtype, q.is_cuda)
    items = (inv if tn.pair_chunk in (0, inv["chunk"])
             else work_items(inv["segoff"], inv["n_pairs"], tn.pair_chunk))
    _pair_fwd_kernel[(items["w_max"],)](
        q, k, v, inv["toks"], inv["segoff"], items["wseg"], items["wchunk"], op, lp, vs,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), T, H, inv["nsb"], inv["nseg"], scale * LOG2E,
        G=G, GP=pairs.group, ROWS=max(tn.pair_rows, gp, 16), LSEL=l_sel, CH=items["chunk"], DK=dk, DV=dv, BDK=bdk,
        BDV=bdv, BS=max(16, next_pow2(l_sel)), DOT_PREC=prec,
        IDS_IN_REGS=pairs.ids_in_regs and items["chunk"] <= 256, WIN=next_pow2(min(items["chunk"], 256)), SCALED=scaled,
        num_warps=tn.pair_warps, num_stages=tn.pair_stages,
        **reg_cap(tn.pair_max_regs, q.is_cuda))
    rank = inv["rank"]
    _pair_merge_kernel[(T, B * H)](
        rank, op, lp, vs, o, lse, rank.stride(0), rank.stride(2), rank.stride(1),
        o.stride(0), o.stride(1), o.stride(2), T, H, G=G, GR=max(16, gp), NSEL=n_sel, DV=dv, BDV=bdv,
        SCALED=scaled, num_warps=tn.merge_warps)
    return o, lse
