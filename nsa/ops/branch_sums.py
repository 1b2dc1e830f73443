"""The row sums D = rowsum(o_c * dO_c) that the NSA backward hands to its flash-attn branches' backward.

A flash-attention backward starts by reading the branch output o_c and its gradient dO_c ([T, heads, d]
each) to form D = rowsum(o_c * dO_c) for every query row (dS = P * (dP - D)). The NSA backward already
has it: dO_c = g_c * dO, so D = g_c * dg_c, where dg_c = rowsum(dO * o_c) is the gate gradient it
computes while it reads o_c anyway. For the branches whose backward calls FlashAttention-4's backward
entry itself (the compressed branch on FA4 here, the window on FA4 in window_split.py), o_c is passed as
one broadcast zero row and D as dlse = -D (FA4 forms rowsum(o * dO) - dlse), so that backward no longer
reads o_c: 1 GB per branch at 64k for the paper shape (HQ=64, d=128, bf16).

Protocol: one RowSums per op call. The branch Functions keep it from their forward; the NSA Function,
whose inputs are the branch outputs (so autograd runs its backward first), fills its slot with D in the
branch's lse layout. A branch finding its slot empty (e.g. the NSA Function computed that branch itself)
reads o_c as before. D differs from FA4's own in rounding only: g_c * rowsum(dO * o_c) in fp32 against
rowsum(o_c * bf16(g_c * dO)).

backend "reference" is fp32 math with the same protocol: the CPU tests of the layouts of D.
"""
from __future__ import annotations

import warnings

import torch

from .fa4_accum import Accum, fa4_bwd, reference_a, to_accum, zero_rows
from . import fallbacks
from .fallbacks import count_fallback
from .flash import _flash, _mask, dense_attention, flash_lse, reference_attention


class RowSums:
    """Slots cmp / win: D of that branch (fp32, in the branch's lse layout) or None; `wants` names the
    slots a recorded branch will read (only those are filled). keep_dq: the op's QFork node reads the
    branches' gradients of q (qsum.py), so a branch on FA4 may leave its fp32 dq accumulator in slot
    cmp_dq / win_dq (fa4_accum.Accum) and hand autograd a zero placeholder for q's gradient instead.
    win_shift: ln g_win [B, HQ, T] where the window wants its gate in its lse ("win_shift" in wants): then
    the window's dO is the op's, unscaled, and win holds dg_win (window_split.py)."""

    __slots__ = ("cmp", "win", "wants", "keep_dq", "cmp_dq", "win_dq", "win_shift")

    def __init__(self) -> None:
        self.cmp: torch.Tensor | None = None
        self.win: torch.Tensor | None = None
        self.wants: set[str] = set()
        self.keep_dq = False
        self.cmp_dq: Accum | None = None
        self.win_dq: Accum | None = None
        self.win_shift: torch.Tensor | None = None

    def take(self, name: str) -> "torch.Tensor | Accum | None":
        """The slot's D (or dq accumulator), emptied (its memory is free once its reader has used it)."""
        d = getattr(self, name)
        setattr(self, name, None)
        return d


def reference_grads(q, k, v, do, d_rows, causal: bool, window: int | None, scale: float,
                    lse_shift: torch.Tensor | None = None):
    """(dq, dk, dv) of attention in fp32 math (fp64 for fp64) given D = d_rows [B, HQ, Tq]; q [B, Tq, HQ, dk],
    k/v [B, Tk, H, *] (HQ = G * H, query head h*G + g on KV head h), dO [B, Tq, HQ, dv]. The flash
    backward's formula, so a wrong D layout shows as wrong gradients in the CPU tests; P from a log-sum-exp
    recomputed at this precision (the forward's lse is fp32), minus lse_shift [B, HQ, Tq] where given (as
    the FA4 path subtracts it from the forward's lse)."""
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    G = q.shape[2] // k.shape[2]
    qf, dof = q.to(ct), do.to(ct)
    kf, vf = (x.to(ct).repeat_interleave(G, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    mask = _mask(q.shape[1], k.shape[1], causal, window, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - (lse if lse_shift is None else lse - lse_shift.to(ct)[..., None]))
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    ds = p * (dp - d_rows.to(ct)[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    B, Tk, H = k.shape[:3]
    dk = dk.view(B, Tk, H, G, -1).sum(3)
    dv = dv.view(B, Tk, H, G, -1).sum(3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_fwd(backend: str, q, k, v, *, scale: float, window: int | None):
    """(o, lse [B, HQ, Tq] fp32) of causal attention (window: the `window` most recent keys) on flash-attn,
    or fp32 math for "reference"; no autograd node (the callers' Functions run it with grad mode off)."""
    if backend == "reference":
        return reference_attention(q, k, v, True, window, scale)
    return _flash(backend, q, k, v, True, window, scale, True)


def flash_bwd(backend: str, q, k, v, o, do, lse, d_rows, *, scale: float, window: int | None,
              keep_dq: bool = False, lse_shift: torch.Tensor | None = None):
    """(dq, dk, dv) of causal attention (window: the `window` most recent keys) through FA4's backward
    entry (fa4_accum.py), or fp32 math for "reference"; with d_rows (D) given, o is not read; keep_dq: dq
    may come as FA4's fp32 accumulator (an Accum; "reference" always gives one, its stand-in). lse_shift
    (lse's layout, with d_rows): P is taken as exp(s - lse + lse_shift), i.e. each row's probabilities
    times exp(lse_shift): a per-row factor g of dO folded into P with lse_shift = ln g and D = rowsum(o * dO)
    for the unscaled dO (dV = (gP)^T dO and dS = gP (dP - D) are the gradients for g * dO)."""
    if backend == "reference":
        if d_rows is None:
            ct = torch.promote_types(o.dtype, torch.float32)
            d_rows = (o.to(ct) * do.to(ct)).sum(-1).transpose(1, 2)
        dq, dk, dv = reference_grads(q, k, v, do, d_rows, True, window, scale, lse_shift)
        return (to_accum(dq, scale, reference_a(q.shape[-1])) if keep_dq else dq), dk, dv
    if lse_shift is not None:
        lse = lse - lse_shift
    return fa4_bwd(q, k, v, o, do, lse, d_rows, scale=scale, window=window, keep_dq=keep_dq)


def q_grad(dq, q: torch.Tensor, sums: "RowSums | None", slot: str) -> torch.Tensor:
    """A branch backward's gradient of q: dq itself, or for an Accum (kept for QFork: sums.keep_dq) the
    accumulator into sums' slot and a zero placeholder shaped like q (stride 0 but in the last dim, so
    views of it stay views) in its place."""
    if not isinstance(dq, Accum):
        return dq
    setattr(sums, slot, dq)
    return zero_rows(q)


def public_bwd(backend: str, q, k, v, do, window: int | None, scale: float):
    """(dq, dk, dv) of causal (window: windowed) GQA attention through the public path: flash-attn's own
    autograd node, which reads o itself (where its backward entry failed once on the device)."""
    x = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out = dense_attention(x[0], x[1], x[2], causal=True, window=window, scale=scale, backend=backend)
        return torch.autograd.grad(out, x, do)


def causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, backend: str,
                 sums: RowSums | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over a square problem on flash-attn's layout, q [B,N,HQ',dk], k/v [B,N,H,*] ->
    (o [B,N,HQ',dv], lse [B,HQ',N] fp32, not differentiable), whose backward takes D from sums.cmp when
    the NSA backward filled it. backend "fa4" or "reference"."""
    if backend != "reference" and fallbacks.refused("cmp_entry", (str(q.device),)):   # FA4's autograd instead
        return flash_lse(q, k, v, scale, backend)
    return _CausalFlash.apply(q, k, v, scale, backend, sums)


class _CausalFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, backend, sums):
        o, lse = flash_fwd(backend, q, k, v, scale=scale, window=None)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.backend, ctx.sums = scale, backend, sums
        if sums is not None:
            sums.wants.add("cmp")
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        d_rows = ctx.sums.take("cmp") if ctx.sums is not None else None
        d_rows = None if d_rows is None else d_rows.view(lse.shape)   # the gate kernel's [B, HQ' * N]
        do = do.contiguous()
        dev = str(q.device)
        if ctx.backend == "reference" or not fallbacks.refused("cmp_entry", (dev,)):
            try:
                keep = ctx.sums is not None and ctx.sums.keep_dq
                dq, dk, dv = flash_bwd(ctx.backend, q, k, v, o, do, lse, d_rows, scale=ctx.scale, window=None,
                                       keep_dq=keep)
                return q_grad(dq, q, ctx.sums, "cmp_dq"), dk, dv, None, None, None
            except Exception as exc:  # noqa: BLE001 - a private entry point: any failure means the public path
                if ctx.backend == "reference" or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                    raise
                why = f"{type(exc).__name__}: {str(exc)[:120]}"
                fallbacks.refuse("cmp_entry", (dev,), why)
                count_fallback(f"cmp_rowsums:{ctx.backend}->autograd")
                warnings.warn(f"compressed branch: flash-attn's backward entry failed ({why}); its "
                              "public backward from now on", RuntimeWarning, stacklevel=2)
        return (*public_bwd(ctx.backend, q, k, v, do, None, ctx.scale), None, None, None)
