"""NSA forward/backward on the Triton kernels, wired as one torch.autograd.Function.

Forward: compressed attention (o_cmp, lse_cmp) -> block_idx from recomputed p_cmp (scores and top-n
fused in scores.select_blocks; no score tensor is stored) -> selected attention (o_slc, lse_slc; per
token, block by block with tuning.select.loop (select_block.py, whose inversion of the selection the
dK/dV kernel reuses), or with tuning.tile.m > 1 on query tiles of m tokens, select_tile.py, whose block
unions the backward reuses) -> window attention (o_win, lse_win) -> gated sum.
Backward: dgates[c] = rowsum(dO * o_c) (fp32), which is also delta_c / g_c, so each branch's
backward reads dO and scales it by its gate on the fly (no per-branch dO tensor is stored).
dq is accumulated across the three branches in one fp32 buffer, in a fixed order.

Compressed branch on a dense kernel (tuning.cmp_dense, nsa/ops/tuning.py): on CUDA with fp16/bf16 the
compressed attention can run as one grouped-query causal SDPA call (cuDNN or flash, cmp_dense.py) outside the Function;
its output (left in the dense problem's rows, read through row_slot) and log-sum-exp come in as
o_cmp / lse_cmp, the Function returns g_cmp * dO in those rows as their gradient and autograd runs that
kernel's backward. The window branch on flash-attn likewise. q reaches those branches through one
QFork node, whose backward sums the three branches' gradients of q in one pass, or runs the selection's
dq kernels there with the other two added in their epilogue (qsum.py).
"""
from __future__ import annotations

import torch
import triton

from ..flash import dense_attention
from .. import window_split
from ..branch_sums import RowSums
from ..plan import OpPlan, plan_call, refuse_branch
from ..tuning import KernelTuning
from . import cmp_dense
from .gates import Combine, combine, gate_grads  # noqa: F401 - combine / gate_grads: also the benchmarks'
from .attn import attn_bwd, attn_fwd
from .scores import select_blocks
from .select import dq_buffer, invert_selection, slc_bwd, slc_dkdv, slc_fwd
from .select_block import pair_buffer, pair_dq, slc_fwd_pairs
from .select_tile import TileUnion, slc_bwd_tile, slc_fwd_tile, tile_unions
from .qsum import DeferredDq, fork_q


class NSATritonFunction(torch.autograd.Function):
    """Inputs must have unit stride in their last dim; gates contiguous [B,T,HQ,3]."""

    @staticmethod
    def forward(ctx, q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, o_cmp_in, lse_cmp_in, o_win_in, cmp_rows,
                l, d, l_sel, n_sel, w, scale, plan: OpPlan, sums, deferred):
        ctx.ext_cmp, ctx.ext_win = o_cmp_in is not None, o_win_in is not None
        ctx.sums = sums   # the branches' RowSums (branch_sums.py), filled by the backward
        ctx.deferred = deferred   # QFork's DeferredDq (qsum.py): where the backward may leave the selection's dq
        ctx.cmp_rows = cmp_rows   # o_cmp_in in the dense problem's rows: their CmpMaps, else None
        tn, chunk = plan.tuning, plan.chunk
        if ctx.ext_cmp:   # computed outside (dense SDPA); k_cmp only feeds the block scores here
            o_cmp, lse_cmp = o_cmp_in.contiguous(), lse_cmp_in.contiguous()
        else:
            o_cmp, lse_cmp = attn_fwd(q, k_cmp, v_cmp, stride=d, offset=l - 1, window=0, scale=scale, tuning=tn.attn)
        if ctx.ext_win:   # computed outside (flash-attn): its own autograd node owns q/k_win/v_win's grads
            o_win, lse_win = o_win_in.contiguous(), o_win_in.new_empty(0)
        else:   # before the selection, whose forward may write the op's output (Combine)
            o_win, lse_win = attn_fwd(q, k_win, v_win, stride=1, offset=0, window=w, scale=scale, tuning=tn.attn)
        # also for T < l (no compressed token): lse_cmp is -inf there, every score is 0
        block_idx = select_blocks(q, k_cmp, lse_cmp, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale,
                                  tuning=tn.scores, gluon=plan.scores == "gluon",
                                  relayout=plan.relayout)
        # block-order forward: the pair inversion it walks is the one the dK/dV kernel walks, kept for it;
        # dq from pair partials after a per-token forward makes it in the backward (nothing held between)
        ctx.inv = inv = invert_selection(block_idx, l_sel, chunk, ranks=True) if plan.fwd == "block" else None
        union = ()
        if plan.m > 1:   # query tiles: the union [B,H,T/m,m*n_sel] is built once here and reused by the backward
            fused = Combine.of(o_cmp, o_win, gates, cmp_rows) if plan.combine else None
            union = tile_unions(block_idx, plan.m, group=plan.tile_group, n_blocks=triton.cdiv(k_slc.shape[1], l_sel))
            o_slc, lse_slc = slc_fwd_tile(q, k_slc, v_slc, block_idx, l_sel=l_sel, scale=scale, m=plan.m, union=union,
                                          tuning=tn.tile, combine=fused, gluon_stages=plan.fwd_gluon)
            o = fused.out if fused is not None else combine(o_cmp, o_slc, o_win, gates, cmp_rows)
        else:
            o_slc, lse_slc = slc_fwd_pairs(q, k_slc, v_slc, block_idx, inv, l_sel=l_sel, scale=scale, chunk=chunk,
                                           tuning=tn.select, pairs=plan.pairs) if inv is not None else \
                slc_fwd(q, k_slc, v_slc, block_idx, l_sel=l_sel, scale=scale, tuning=tn.select)
            o = combine(o_cmp, o_slc, o_win, gates, cmp_rows)
        ctx.save_for_backward(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, o_cmp, o_slc, o_win,
                              lse_cmp, lse_slc, lse_win, block_idx, *union)
        ctx.hp = (l, d, l_sel, w, scale, plan)
        ctx.mark_non_differentiable(block_idx)
        return o, block_idx

    @staticmethod
    def backward(ctx, do, _dbi):
        (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, o_cmp, o_slc, o_win,
         lse_cmp, lse_slc, lse_win, block_idx, *union) = ctx.saved_tensors
        l, d, l_sel, w, scale, plan = ctx.hp
        tn, chunk = plan.tuning, plan.chunk
        do = do.contiguous()
        if do.data_ptr() % 16:   # the TMA walks read dO by rows: an aligned copy (same values)
            do = do.clone()
        # dgates [B,T,HQ,3] fp32, and for branches computed outside their outputs' gradients g_c * dO
        dg, do_cmp, do_win = gate_grads(do, o_cmp, o_slc, o_win, gates, ctx.ext_cmp, ctx.ext_win, ctx.cmp_rows,
                                        ctx.sums)
        dq = dkc = dvc = None
        if not ctx.ext_cmp:
            dq, dkc, dvc = attn_bwd(q, k_cmp, v_cmp, do, lse_cmp, dg[..., 0].contiguous(), gates[..., 0],
                                    stride=d, offset=l - 1, window=0, scale=scale, dq_dtype=torch.float32,
                                    tuning=tn.attn)
        # dq accumulates in fp32 over the branches run here; the last of them writes q's dtype. With both
        # flash branches outside, the selection's dq kernels may wait for their gradients of q (QFork's
        # backward adds them in those kernels' epilogue): `later` collects them
        later = [] if ctx.deferred is not None and ctx.ext_cmp and ctx.ext_win else None
        args = (q, k_slc, v_slc, block_idx, do, lse_slc, dg[..., 1].contiguous(), gates[..., 1])
        kw = dict(l_sel=l_sel, scale=scale, chunk=chunk, dq_in=dq, dq_dtype=q.dtype if ctx.ext_win else torch.float32,
                  walk=plan.walk)
        if plan.bwd == "tile":
            dq, dks, dvs = slc_bwd_tile(*args, m=plan.m, union=TileUnion(*union), tuning=tn.tile, select=tn.select,
                                        later=later, dq_gluon=plan.dq_gluon, **kw)
        elif plan.bwd == "pairs":   # pair_dq sums each token's partials by their ranks
            inv = ctx.inv if ctx.inv is not None else invert_selection(block_idx, l_sel, chunk, ranks=True)
            dq, dks, dvs = _slc_bwd_pairs(inv, *args, tuning=tn.select, pairs=plan.pairs, later=later, **kw)
        else:   # the per-token dq kernel: nothing appended to later
            dq, dks, dvs = slc_bwd(*args, tuning=tn.select, inv=ctx.inv, **kw)
        dkw = dvw = None
        if not ctx.ext_win:
            dq, dkw, dvw = attn_bwd(q, k_win, v_win, do, lse_win, dg[..., 2].contiguous(), gates[..., 2],
                                    stride=1, offset=0, window=w, scale=scale, dq_in=dq, dq_dtype=q.dtype,
                                    tuning=tn.attn)
        if later:   # q's gradient comes from QFork's backward, which runs these
            ctx.deferred.tasks, dq = later, None
        return (dq, dkc, dvc, dks, dvs, dkw, dvw, dg.to(gates.dtype), do_cmp, None, do_win,
                None, None, None, None, None, None, None, None, None, None)


def _slc_bwd_pairs(inv: dict, q, k, v, block_idx, do, lse, delta, gate, *, l_sel: int, scale: float, chunk: int,
                   dq_in, tuning, pairs, walk, dq_dtype=None, later: list | None = None):
    """(dq, dK, dV) of the selection block by block: one dK/dV walk that also writes each (token, block)
    pair's dq partial, then their per-token sum (+ dq_in) into a dq_buffer; with `later` that sum is
    appended there as a task (qsum.DeferredDq) and dq is None."""
    H, n_sel = k.shape[2], block_idx.shape[3]
    dqp = pair_buffer(q, n_sel, H, q.shape[-1], pairs, dq=True)
    dks, dvs = slc_dkdv(q, k, v, block_idx, do, lse, delta, gate, l_sel=l_sel, scale=scale, chunk=chunk,
                        tuning=tuning, inv=inv, dq_pairs=dqp, walk=walk)
    if later is not None:
        later.append(lambda out, add: pair_dq(q, dqp, inv, n_sel, H, dq=out, dq_in=dq_in, add=add))
        return None, dks, dvs
    return pair_dq(q, dqp, inv, n_sel, H, dq=dq_buffer(q, dq_in, dq_dtype), dq_in=dq_in), dks, dvs


def nsa_triton_apply(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, *, l: int, d: int, l_sel: int,
                     n_sel: int, w: int, scale: float, dkdv_chunk: int | None = None,
                     tuning: KernelTuning | None = None):
    """Make layouts kernel-friendly, plan the call (nsa/ops/plan.py), run the branches computed outside
    and the autograd.Function (inputs already validated).

    tuning: launch parameters of every kernel (None: the preset of q's device).
    dkdv_chunk: queries per program in the selection dK/dV kernel (long lists are split and their
    fp32 partials added in a fixed order; None: the plan's); small values exercise that path in tests."""
    def unit(x: torch.Tensor) -> torch.Tensor:
        return x if x.stride(-1) == 1 else x.contiguous()

    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = map(unit, (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win))
    plan = plan_call(q, k_cmp, v_cmp, k_slc, v_slc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, tuning=tuning,
                     chunk=dkdv_chunk)
    ext_cmp, ext_win = plan.cmp != "triton", plan.win != "triton"
    bnhd = ext_cmp and cmp_dense.bnhd_layout(plan.cmp)
    maps = cmp_dense.cmp_maps(q, k_cmp, l=l, d=d, bnhd=bnhd) if ext_cmp else None
    deferred = DeferredDq() if plan.dq_fold else None
    # D of the flash branches from the gate gradients (branch_sums.py): their backward skips reading o
    sums = RowSums() if plan.row_sums else None
    q_cmp, q_win, q_slc = fork_q(q, maps, ext_win, deferred, sums)
    if sums is not None:   # QFork reads the branches' gradients of q: FA4's dq accumulators will do (fa4_accum.py)
        sums.keep_dq = plan.fa4_accum
    o_cmp = lse_cmp = o_win = cmp_rows = None
    if ext_cmp:
        try:
            o_cmp, lse_cmp = cmp_dense.cmp_attention_rows(q_cmp, k_cmp, v_cmp, maps, T=q.shape[1], HQ=q.shape[2],
                                                          scale=scale, backend=plan.cmp, bnhd=bnhd, rows_out=True,
                                                          sums=sums)
            lse_cmp, cmp_rows = lse_cmp.detach(), maps
        except RuntimeError as exc:   # e.g. a shape this cuDNN refuses though the small probe passed
            refuse_branch("cmp", q, v_cmp, plan.cmp, exc)
            o_cmp = lse_cmp = None
    if ext_win:
        try:   # differentiable: flash-attn's own backward gets g_win * dO from the Function
            if plan.win_entry != "plain":
                o_win = window_split.window_attention_split(q_win, k_win, v_win, w, scale, plan.win, sums,
                                                            plan.win_entry == "split", plan.win_gate_lse)
            else:
                o_win = dense_attention(q_win, k_win, v_win, causal=True, window=w, scale=scale, backend=plan.win)
        except (RuntimeError, AssertionError, ValueError) as exc:   # a shape flash-attn refuses
            refuse_branch("win", q, v_win, plan.win, exc)
    return NSATritonFunction.apply(q_slc, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates.contiguous(), o_cmp,
                                   lse_cmp, o_win, cmp_rows, l, d, l_sel, n_sel, w, scale, plan, sums,
                                   deferred if q_slc is not q else None)
