"""q's gradient as one sum over the branches that read q.

The flash-attn branches (the compressed one in the dense problem's rows, the window) take q from one
_QFork node, so autograd hands that node every branch's gradient of q and it sums them in one pass
(_qgrad_kernel): gc [B, S, dk] read back through row_slot, gw and the selection's gs [B, T, HQ, dk].

Folding (FlashBranchTuning.dq_fold): when both flash branches ran outside the NSA Function, the
selection's dq is the last term, so the NSA backward does not compute it; it leaves its dq kernels in
the call's DeferredDq, and _QFork's backward runs them once gc and gw exist, each adding them in its
epilogue (add_q_terms). That skips writing gs and reading it back with gc and gw (4 of the sum's 5
passes over [B, T, HQ, dk]: 2 GB at 64k, paper shape). Autograd runs _QFork's backward after the NSA
Function's and the branches' (they consume its outputs), and not at all when q's gradient is not
wanted; then the deferred kernels are never run.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ..branch_sums import RowSums
from ..fa4_accum import Accum, acc_cols, acc_rows
from . import cmp_dense
from ._utils import next_pow2


class QAdd(NamedTuple):
    """The other branches' gradients of q that a dq kernel adds in its epilogue: gc [B, S, dk] in the
    dense compressed problem's rows with row_slot [T*HQ] (the row of (t, hq), -1: none), gw [B, T, HQ, dk];
    each contiguous, or None. gc_acc / gw_acc: that term as FlashAttention-4's fp32 dq accumulator instead
    (fa4_accum.Accum; gc / gw then unused): the compressed problem's [B, HQ', N_r * dk], the window's
    [B, HQ, T_r * dk] or, split (window_split.py, B = 1), [G, H, T_r * dk] with batch g, head h = query head h*G + g."""
    gc: torch.Tensor | None = None
    row_slot: torch.Tensor | None = None
    gw: torch.Tensor | None = None
    gc_acc: Accum | None = None
    gw_acc: Accum | None = None


def q_add_args(add: QAdd | None, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """(GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s) kernel arguments and their HAS_GC /
    HAS_GW / GC_ACC / GW_ACC constexprs (add_q_terms; dummy: any valid pointer for absent terms; its shape
    [B, T, HQ, dk] is q's)."""
    add = add or QAdd()
    ca, wa = add.gc_acc, add.gw_acc
    gc = ca.buf if ca is not None else add.gc
    gw = wa.buf if wa is not None else add.gw
    HQ = dummy.shape[2]
    cargs = (ca.s_r, ca.buf.shape[1], ca.scale) if ca is not None else (1, 1, 1.0)
    wargs = (wa.s_r, HQ, HQ // wa.buf.shape[1], wa.scale) if wa is not None else (1, 1, 1, 1.0)
    return ((gc if gc is not None else dummy, add.row_slot if gc is not None else dummy,
             gw if gw is not None else dummy, add.gc.stride(0) if add.gc is not None and ca is None else 0,
             *cargs, *wargs),
            dict(HAS_GC=gc is not None, HAS_GW=gw is not None, GC_ACC=ca.a if ca is not None else 0,
                 GW_ACC=wa.a if wa is not None else 0))


@triton.jit
def add_q_terms(acc, GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s, b, rb, row_ok, off, cols,
                D: tl.constexpr, HAS_GC: tl.constexpr, HAS_GW: tl.constexpr, GC_ACC: tl.constexpr,
                GW_ACC: tl.constexpr):
    """acc [R, BD] fp32 + gc[b, SLOT[rb]] (0 where SLOT < 0) + gw at off: rows rb [R] = t * HQ + hq of
    batch b (int64), off [R, BD] their elements' offsets in a contiguous [B, T, HQ, D], cols [BD].
    GC_ACC / GW_ACC = A > 0: that term is FA4's accumulator (QAdd; fa4_accum.acc_rows), times gc_s / gw_s:
    the compressed one of gc_h heads x gc_n rows (dense row j * gc_h + h'), the window's of HQ = gw_h query
    heads over gw_g batches x gw_h / gw_g heads x gw_t rows."""
    m = row_ok[:, None] & (cols[None, :] < D)
    if HAS_GC:
        src = tl.load(SLOT + rb, mask=row_ok, other=-1)
        cm = m & (src >= 0)[:, None]
        if GC_ACC > 0:
            base = (b * gc_h + src % gc_h) * gc_n * D + acc_rows(src // gc_h, D, GC_ACC)
            acc += tl.load(GC + base[:, None] + acc_cols(cols, D, GC_ACC)[None, :], mask=cm, other=0.0) * gc_s
        else:
            acc += tl.load(GC + b * sgc + src[:, None] * D + cols[None, :], mask=cm, other=0.0).to(tl.float32)
    if HAS_GW:
        if GW_ACC > 0:
            hq = rb % gw_h
            base = ((b * gw_h + (hq % gw_g) * (gw_h // gw_g) + hq // gw_g) * gw_t * D
                    + acc_rows(rb // gw_h, D, GW_ACC))
            acc += tl.load(GW + base[:, None] + acc_cols(cols, D, GW_ACC)[None, :], mask=m, other=0.0) * gw_s
        else:
            acc += tl.load(GW + off, mask=m, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _qgrad_kernel(GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s, GS, DQ, n_rows, D: tl.constexpr,
                  BD: tl.constexpr, BR: tl.constexpr, HAS_GC: tl.constexpr, HAS_GW: tl.constexpr,
                  GC_ACC: tl.constexpr, GW_ACC: tl.constexpr, HAS_S: tl.constexpr):
    """dq[b, r] = gc[b, SLOT[r]] + gw[b, r] + gs[b, r], summed in fp32; rows of D contiguous elements,
    gw/gs/dq [B, n_rows, D] (each term only where HAS_*; gc / gw as add_q_terms reads them)."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    ok = r < n_rows
    c = tl.arange(0, BD)
    off = b * n_rows * D + r[:, None] * D + c[None, :]
    acc = add_q_terms(tl.zeros([BR, BD], tl.float32), GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s,
                      b, r, ok, off, c, D, HAS_GC, HAS_GW, GC_ACC, GW_ACC)
    if HAS_S:
        acc += tl.load(GS + off, mask=ok[:, None] & (c[None, :] < D), other=0.0).to(tl.float32)
    tl.store(DQ + off, acc.to(DQ.dtype.element_ty), mask=ok[:, None] & (c[None, :] < D))


class DeferredDq:
    """The selection's dq kernels left by the NSA backward (dq_fold): each task(dq, add) writes its part
    of q's gradient (the device's per-call choice guards which) plus `add`'s terms into dq."""

    __slots__ = ("tasks",)

    def __init__(self) -> None:
        self.tasks: list[Callable[[torch.Tensor, QAdd], None]] = []

    def run(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, add: QAdd) -> torch.Tensor:
        tasks, self.tasks = self.tasks, []   # their saved tensors are freed with them
        dq = torch.empty(shape, device=device, dtype=dtype)
        for task in tasks:
            task(dq, add)
        return dq


class QFork(torch.autograd.Function):
    """q handed to the branches computed outside the Function: (q's rows gathered into the dense
    compressed problem's order when slot_src is given, then n_alias <= 2 views of q: the window's when
    n_alias = 2, the Function's). The backward sums every branch's gradient of q in one pass (the
    compressed one gathered back through row_slot), where autograd would gather it and then add the three
    pairwise in q's dtype (two more passes over [B,T,HQ,dk], and two roundings); or, with deferred dq
    kernels, runs them with the branches' gradients as their epilogue's terms. sums: the call's RowSums,
    whose cmp_dq / win_dq slots hold a flash branch's fp32 accumulator in place of its gradient (then
    autograd hands this node that branch's zero placeholder, branch_sums.py)."""

    @staticmethod
    def forward(ctx, q, slot_src, row_slot, n_alias, deferred, sums=None):
        ctx.set_materialize_grads(False)   # a branch that fell back leaves its output unused: None
        ctx.has_rows, ctx.win, ctx.shape, ctx.deferred = slot_src is not None, n_alias > 1, q.shape, deferred
        ctx.dtype, ctx.device, ctx.sums = q.dtype, q.device, sums
        ctx.save_for_backward(row_slot)
        B, T, HQ, dk = q.shape
        rows = (cmp_dense.gather_rows(q.reshape(B, T * HQ, dk), slot_src),) if ctx.has_rows else ()
        return (*rows, *(q.view_as(q) for _ in range(n_alias)))

    @staticmethod
    def backward(ctx, *grads):
        (row_slot,) = ctx.saved_tensors
        g = list(grads)
        gc = g.pop(0) if ctx.has_rows else None
        gw = g.pop(0) if ctx.win else None
        gs = g.pop(0)
        acc_c = ctx.sums.take("cmp_dq") if ctx.sums is not None else None
        acc_w = ctx.sums.take("win_dq") if ctx.sums is not None else None
        gc = None if acc_c is not None or gc is None else gc.contiguous()
        gw = None if acc_w is not None or gw is None else gw.contiguous()
        add = QAdd(gc, row_slot, gw, acc_c, acc_w)
        none = (None,) * 5
        if ctx.deferred is not None and ctx.deferred.tasks:   # the NSA backward left q's last term (gs is None)
            return (ctx.deferred.run(ctx.shape, ctx.dtype, ctx.device, add), *none)
        terms = [x for x in (gw, gs) if x is not None]
        if len(terms) < 2 and gc is None and acc_c is None and acc_w is None:   # q's layout already: no pass
            return (terms[0] if terms else None), *none
        B, T, HQ, dk = ctx.shape
        dq = torch.empty(ctx.shape, device=ctx.device, dtype=ctx.dtype)
        n = T * HQ
        if n and B:
            bd = max(16, next_pow2(dk))
            br = max(1, min(64, 4096 // bd))
            add_args, add_kw = q_add_args(add, dq)
            gs_arg = gs.contiguous() if gs is not None else dq   # unused operand: any valid pointer
            _qgrad_kernel[(triton.cdiv(n, br), B)](*add_args, gs_arg, dq, n, D=dk, BD=bd, BR=br,
                                                   HAS_S=gs is not None, **add_kw)
        return dq, *none


def fork_q(q: torch.Tensor, maps: cmp_dense.CmpMaps | None, win: bool, deferred: DeferredDq | None = None,
          sums: RowSums | None = None):
    """(q rows for the dense compressed branch or None, q for the flash window branch, q for the
    Function). With q's gradient wanted, one QFork node hands them out, so q's gradient is one
    fused sum of the branches' (plain tensors, and no node, otherwise); deferred: where the NSA
    backward may leave its dq kernels for that node (qsum.py); sums: the call's RowSums (its dq slots)."""
    B, T, HQ, dk = q.shape
    if not (torch.is_grad_enabled() and q.requires_grad) or (maps is None and not win):
        rows = cmp_dense.gather_rows(q.reshape(B, T * HQ, dk), maps.slot_src) if maps is not None else None
        return rows, q, q
    out = list(QFork.apply(q, maps.slot_src if maps is not None else None,
                           maps.row_slot if maps is not None else None, 1 + int(win), deferred, sums))
    rows = out.pop(0) if maps is not None else None
    return rows, (out[0] if win else q), out[-1]
