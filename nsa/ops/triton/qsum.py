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

from . import cmp_dense
from ._utils import next_pow2


class QAdd(NamedTuple):
    """The other branches' gradients of q that a dq kernel adds in its epilogue: gc [B, S, dk] in the
    dense compressed problem's rows with row_slot [T*HQ] (the row of (t, hq), -1: none), gw [B, T, HQ, dk];
    each contiguous, or None."""
    gc: torch.Tensor | None = None
    row_slot: torch.Tensor | None = None
    gw: torch.Tensor | None = None


def q_add_args(add: QAdd | None, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """(GC, SLOT, GW, sgc) kernel arguments and their HAS_GC / HAS_GW constexprs (dummy: any valid
    pointer for absent terms)."""
    gc = add.gc if add is not None else None
    gw = add.gw if add is not None else None
    return ((gc if gc is not None else dummy, add.row_slot if gc is not None else dummy,
             gw if gw is not None else dummy, gc.stride(0) if gc is not None else 0),
            dict(HAS_GC=gc is not None, HAS_GW=gw is not None))


@triton.jit
def add_q_terms(acc, GC, SLOT, GW, sgc, b, rb, row_ok, off, cols, D: tl.constexpr, HAS_GC: tl.constexpr,
                HAS_GW: tl.constexpr):
    """acc [R, BD] fp32 + gc[b, SLOT[rb]] (0 where SLOT < 0) + gw at off: rows rb [R] = t * HQ + hq of
    batch b (int64), off [R, BD] their elements' offsets in a contiguous [B, T, HQ, D], cols [BD]."""
    m = row_ok[:, None] & (cols[None, :] < D)
    if HAS_GC:
        src = tl.load(SLOT + rb, mask=row_ok, other=-1)
        acc += tl.load(GC + b * sgc + src[:, None] * D + cols[None, :], mask=m & (src >= 0)[:, None],
                       other=0.0).to(tl.float32)
    if HAS_GW:
        acc += tl.load(GW + off, mask=m, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _qgrad_kernel(GC, SLOT, GW, GS, DQ, n_rows, sgc, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr,
                  HAS_GC: tl.constexpr, HAS_GW: tl.constexpr, HAS_S: tl.constexpr):
    """dq[b, r] = gc[b, SLOT[r]] + gw[b, r] + gs[b, r], summed in fp32; rows of D contiguous elements,
    gw/gs/dq [B, n_rows, D] (each term only where HAS_*)."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    ok = r < n_rows
    c = tl.arange(0, BD)
    off = b * n_rows * D + r[:, None] * D + c[None, :]
    acc = add_q_terms(tl.zeros([BR, BD], tl.float32), GC, SLOT, GW, sgc, b, r, ok, off, c, D, HAS_GC, HAS_GW)
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
    compressed problem's order when slot_src is given, then n_alias <= 2 views of q). The backward
    sums every branch's gradient of q in one pass (the compressed one gathered back through
    row_slot), where autograd would gather it and then add the three pairwise in q's dtype (two more
    passes over [B,T,HQ,dk], and two roundings); or, with deferred dq kernels, runs them with the
    branches' gradients as their epilogue's terms."""

    @staticmethod
    def forward(ctx, q, slot_src, row_slot, n_alias, deferred):
        ctx.set_materialize_grads(False)   # a branch that fell back leaves its output unused: None
        ctx.has_rows, ctx.shape, ctx.deferred = slot_src is not None, q.shape, deferred
        ctx.dtype, ctx.device = q.dtype, q.device
        ctx.save_for_backward(row_slot)
        B, T, HQ, dk = q.shape
        rows = (cmp_dense.gather_rows(q.reshape(B, T * HQ, dk), slot_src),) if ctx.has_rows else ()
        return (*rows, *(q.view_as(q) for _ in range(n_alias)))

    @staticmethod
    def backward(ctx, *grads):
        (row_slot,) = ctx.saved_tensors
        gc = grads[0] if ctx.has_rows else None
        gc = gc.contiguous() if gc is not None else None
        rest = [g.contiguous() for g in grads[int(ctx.has_rows):] if g is not None]
        none = (None,) * 4
        if ctx.deferred is not None and ctx.deferred.tasks:   # the NSA backward left q's last term: rest = [gw]
            gw = rest[0] if rest else None
            return (ctx.deferred.run(ctx.shape, ctx.dtype, ctx.device, QAdd(gc, row_slot, gw)), *none)
        if gc is None and len(rest) < 2:
            return (rest[0] if rest else None), *none
        B, T, HQ, dk = ctx.shape
        ref = gc if gc is not None else rest[0]
        dq = torch.empty(ctx.shape, device=ref.device, dtype=ref.dtype)
        n = T * HQ
        if n and B:
            bd = max(16, next_pow2(dk))
            br = max(1, min(64, 4096 // bd))
            gw, gs = (rest + [dq, dq])[:2]   # unused operands: any valid pointer
            _qgrad_kernel[(triton.cdiv(n, br), B)](gc if gc is not None else dq, row_slot if gc is not None else dq,
                                                   gw, gs, dq, n, gc.stride(0) if gc is not None else 0, D=dk, BD=bd,
                                                   BR=br, HAS_GC=gc is not None, HAS_GW=len(rest) > 0,
                                                   HAS_S=len(rest) > 1)
        return dq, *none
