"""The sliding-window branch on flash-attn, with a backward that sees no grouped-query heads.

FlashAttention-4's Hopper backward serves GQA (HQ = G * H query heads) by adding each query head's dK / dV
into fp32 buffers of the KV heads ([B, H, T, d] each) and converting them afterwards. For the window branch at
long T that path is much slower than the same problem without GQA, whatever the grouping factor; only G = 1 is
fast (docs/kernels.md, window split).

So the forward is flash-attn's own GQA call (its fastest), and the backward calls the same backward kernel on
views that make the G query heads of each KV head G batches of H heads: batch g, head h is query head h*G + g,
and K / V are broadcast over the batches (batch stride 0). q, o, dO and dq are strided views of the [1, T, HQ, d]
tensors, never copied. Each batch writes its own dK / dV (in the input dtype); their sum over the G batches,
in fp32 and in a fixed order, is K's and V's gradient (one pass over G * T * H * d elements each).

Rounding: each batch's partial is rounded to the input dtype before the sum, so dK / dV carry G roundings
instead of one (slightly larger relative RMS against fp32 math: docs/kernels.md). dq is unchanged.
Memory: the partials hold G times K's and V's size during the backward (2 x 1 GB at 64k for the paper shape).

The split is taken only where it pays (FlashBranchTuning.win_split_min_t) and where the views exist: B == 1 (a
batch dimension would need two strides), G > 1, q contiguous. The backward goes through flash-attn's private
backward entry (nsa/ops/fa4_accum.py); where that is missing or raises, the call runs the public GQA backward
instead (counted and warned once per device). Elsewhere the same Function runs unsplit (FA4's GQA backward
through the same entry) where the op keeps FA4's dq accumulator for q's gradient (FlashBranchTuning.fa4_accum).

The op's gate (FlashBranchTuning.win_gate_lse): the branch output's gradient is g * dO (g [B, T, HQ], one
gate per query row), which the gate kernel would write out only for this backward to read. Instead the
backward reads dO itself with P' = g * P, i.e. lse - ln g as FA4's lse, and D = rowsum(o * dO) = dg (the gate's
gradient, which the NSA backward has): dV = P'^T dO and dS = P' * (dP - D) are the gradients of g * dO. The
NSA backward hands this node dO unscaled and ln g in sums.win_shift; g = 0 gives lse = +inf, P' = 0.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from ..config import triton_interpreter
from .branch_sums import RowSums, flash_bwd, flash_fwd, public_bwd, q_grad
from .fa4_accum import Accum
from . import fallbacks
from .fallbacks import count_fallback

def window_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float,
                           backend: str, sums: RowSums | None = None, split: bool = True,
                           gate_lse: bool = False) -> torch.Tensor:
    """Causal attention over the `window` most recent keys, q [B,T,HQ,d], k/v [B,T,H,*] -> o [B,T,HQ,dv];
    differentiable in q, k, v, with the split backward (module doc; the plan's win_entry "split": B = 1, G > 1, q contiguous) or, split=False,
    FA4's GQA backward through the same entry (for the row sums and the kept dq accumulator). backend:
    "fa4", or "reference" (fp32 math in both passes: the CPU tests of the views and the batch sum). sums:
    the op call's RowSums, whose win slot [B, HQ, T] the NSA backward may fill (branch_sums.py: then o is
    not read again) and whose win_dq slot may take the dq accumulator (sums.keep_dq). gate_lse (with sums):
    the op's gate of this branch goes into the backward's lse instead of into dO (module doc)."""
    return _WindowSplit.apply(q, k, v, window, scale, backend, sums, split, gate_lse)


class _WindowSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, scale, backend, sums, split, gate_lse):
        o, lse = flash_fwd(backend, q, k, v, scale=scale, window=window)   # grad mode is off: no flash-attn node
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window, ctx.scale, ctx.backend, ctx.sums, ctx.split = window, scale, backend, sums, split
        if sums is not None:
            sums.wants.update(("win", "win_shift") if gate_lse else ("win",))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        _, T, HQ, d = q.shape
        H, dv = k.shape[2], v.shape[3]
        G = HQ // H

        def grouped(x: torch.Tensor, dx: int) -> torch.Tensor:
            """[1, T, HQ, dx] (contiguous) -> the [G, T, H, dx] view: batch g, head h = query head h*G + g."""
            return x.contiguous().view(T, H, G, dx).permute(2, 0, 1, 3)

        def heads(x: torch.Tensor) -> torch.Tensor:
            """[1, HQ, T] (lse's layout) -> the [G, H, T] view of the same batches."""
            return x.contiguous().view(H, G, T).permute(1, 0, 2)

        d_rows = ctx.sums.take("win") if ctx.sums is not None else None
        shift = ctx.sums.take("win_shift") if ctx.sums is not None else None   # do is the op's dO: g in P
        if ctx.split:
            args = (grouped(q, d), k.expand(G, T, H, d), v.expand(G, T, H, dv), grouped(o, dv), grouped(do, dv),
                    heads(lse), None if d_rows is None else heads(d_rows))
            shift_arg = None if shift is None else heads(shift)
        else:
            args = (q, k, v, o, do.contiguous(), lse, d_rows)
            shift_arg = shift
        dev = str(q.device)
        dqb = None
        keep = ctx.sums is not None and ctx.sums.keep_dq
        if not fallbacks.refused("win_entry", (dev,)):   # after a failure: flash-attn's GQA backward
            try:
                dqb, dkb, dvb = flash_bwd(ctx.backend, *args, scale=ctx.scale, window=ctx.window, keep_dq=keep,
                                          lse_shift=shift_arg)
            except Exception as exc:  # noqa: BLE001 - a private entry point: any failure means the public path
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                why = f"{type(exc).__name__}: {str(exc)[:120]}"
                fallbacks.refuse("win_entry", (dev,), why)   # the planner plans the split away
                count_fallback(f"win_split:{ctx.backend}->gqa")
                warnings.warn(f"window branch: FA4's backward entry failed ({why}); flash-attn's GQA "
                              "backward from now on", RuntimeWarning, stacklevel=2)
        none = (None,) * 6
        if dqb is None:
            if shift is not None:   # the public path takes the branch's own gradient, g * dO
                do = do * shift.exp().transpose(1, 2).unsqueeze(-1).to(do.dtype)
            return (*public_bwd(ctx.backend, q, k, v, do, ctx.window, ctx.scale), *none)
        if ctx.split:   # per-batch dK / dV summed; dq (not an Accum) has the strides of the q view: [1, T, HQ, d]
            dkb, dvb = batch_sum(dkb), batch_sum(dvb)
            if not isinstance(dqb, Accum):
                dqb = dqb.permute(1, 2, 0, 3).reshape(1, T, HQ, d)
        return q_grad(dqb, q, ctx.sums, "win_dq"), dkb, dvb, *none


@triton.jit
def _batch_sum_kernel(X, Y, n, G: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Y[i] = sum over g = 0 .. G-1 of X[g * n + i], accumulated in ACC (fp32; fp64 for fp64) in that order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    ptr = X + offs
    acc = tl.zeros([BLOCK], ACC)
    for _ in range(G):
        acc += tl.load(ptr, mask=ok, other=0.0).to(ACC)
        ptr += n
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def batch_sum(x: torch.Tensor) -> torch.Tensor:
    """x [G, T, H, d] -> [1, T, H, d] in x's dtype: the sum over the G batches in order, in fp32 (fp64 for fp64)."""
    x = x.contiguous()
    G, n = x.shape[0], x[0].numel()
    if not x.is_cuda and not triton_interpreter():   # no Triton device here
        return x.to(torch.float64 if x.dtype == torch.float64 else torch.float32).sum(0, keepdim=True).to(x.dtype)
    y = torch.empty((1, *x.shape[1:]), device=x.device, dtype=x.dtype)
    if n:
        block = 1024
        acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        _batch_sum_kernel[(triton.cdiv(n, block),)](x, y, n, G=G, BLOCK=block, ACC=acc, num_warps=4)
    return y
