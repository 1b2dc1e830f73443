"""NSA forward/backward on the Triton kernels, wired as one torch.autograd.Function.

Forward: compressed attention (o_cmp, lse_cmp) -> block_idx from recomputed p_cmp (scores and top-n
fused in scores.select_blocks; no score tensor is stored) -> selected attention (o_slc, lse_slc; per
token, block by block with tuning.select.loop (select_block.py, whose inversion of the selection the
dK/dV kernel reuses), or with tuning.tile.m > 1 on query tiles of m tokens, select_tile.py, whose block
unions the backward reuses) -> window attention (o_win, lse_win) -> gated sum.
Backward: dgates[c] = rowsum(dO * o_c) (fp32), which is also delta_c / g_c, so each branch's
backward reads dO and scales it by its gate on the fly (no per-branch dO tensor is stored).
dq is accumulated across the three branches in one fp32 buffer, in a fixed order.

The route is data: the call's OpPlan (nsa/ops/plan.py) names each choice, and steps_for maps those names to
this module's step callables through the tables below (_CMP_FWD ... _SLC_BWD); forward and backward run the
steps in a fixed order and decide nothing themselves.

Compressed branch on a dense kernel (tuning.cmp_dense, nsa/ops/tuning.py): on CUDA with fp16/bf16 the
compressed attention can run as one grouped-query causal SDPA call (cuDNN or flash, cmp_dense.py) outside the Function;
its output (left in the dense problem's rows, read through row_slot) and log-sum-exp come in as
o_cmp / lse_cmp, the Function returns g_cmp * dO in those rows as their gradient and autograd runs that
kernel's backward. The window branch on flash-attn likewise. q reaches those branches through one
QFork node, whose backward sums the three branches' gradients of q in one pass, or runs the selection's
dq kernels there with the other two added in their epilogue (qsum.py).
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable, NamedTuple

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


class Steps(NamedTuple):
    """One call's steps, picked from its plan by steps_for (each a callable of this module)."""

    cmp_fwd: Callable     # (o_cmp, lse_cmp): the Triton kernel, or the output computed outside as it is
    win_fwd: Callable     # (o_win, lse_win) likewise (lse_win empty when outside)
    slc_fwd: Callable     # (o, o_slc, lse_slc, inv, union): the selection forward and the gated sum
    cmp_bwd: Callable     # (dq, dk_cmp, dv_cmp): the Triton backward, or nothing (autograd runs the outside one)
    slc_bwd: Callable     # (dq, dk_slc, dv_slc)
    win_bwd: Callable     # (dq, dk_win, dv_win)
    ext_cmp: bool         # the compressed branch ran outside the Function (plan.cmp != "triton")
    ext_win: bool
    fold: bool            # the selection's dq kernels wait for QFork's backward (plan.dq_fold, DeferredDq)


def steps_for(plan: OpPlan) -> Steps:
    """The plan's choices as callables (pure lookups: the choosing was select_plan's)."""
    ext_cmp, ext_win = plan.cmp != "triton", plan.win != "triton"
    return Steps(_CMP_FWD[ext_cmp], _WIN_FWD[ext_win], _SLC_FWD[plan.fwd, plan.combine], _ATTN_BWD[ext_cmp],
                 _SLC_BWD[plan.bwd], _ATTN_BWD[ext_win], ext_cmp, ext_win, plan.dq_fold)


class NSATritonFunction(torch.autograd.Function):
    """Inputs must have unit stride in their last dim; gates contiguous [B,T,HQ,3]."""

    @staticmethod
    def forward(ctx, q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, o_cmp_in, lse_cmp_in, o_win_in, cmp_rows,
                l, d, l_sel, n_sel, w, scale, plan: OpPlan, sums, deferred, pos0: int = 0, win_pos0: int = 0):
        ctx.run = run = steps_for(plan)
        ctx.set_materialize_grads(False)   # block_idx has no gradient: no zero tensor made for it
        ctx.sums = sums   # the branches' RowSums (branch_sums.py), filled by the backward
        ctx.deferred = deferred   # QFork's DeferredDq (qsum.py): where the backward may leave the selection's dq
        ctx.cmp_rows = cmp_rows   # o_cmp_in in the dense problem's rows: their CmpMaps, else None
        tn = plan.tuning
        # outside: computed by dense SDPA / flash-attn, whose own autograd nodes own their inputs' grads (k_cmp
        # then only feeds the block scores); the window runs before the selection, which may write the output
        # pos0 > 0 (plan.q_off): query row t sits at position pos0 + t, the window's keys start at win_pos0
        o_cmp, lse_cmp = run.cmp_fwd(q, k_cmp, v_cmp, o_cmp_in, lse_cmp_in, stride=d, offset=l - 1, window=0,
                                     scale=scale, tuning=tn.attn, q_off=pos0)
        o_win, lse_win = run.win_fwd(q, k_win, v_win, o_win_in, None, stride=1, offset=0, window=w, scale=scale,
                                     tuning=tn.attn, q_off=pos0 - win_pos0)
        # also for T < l (no compressed token): lse_cmp is -inf there, every score is 0
        block_idx = select_blocks(q, k_cmp, lse_cmp, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale,
                                  tuning=tn.scores, gluon=plan.scores == "gluon",
                                  relayout=plan.relayout, q_off=pos0)
        o, o_slc, lse_slc, ctx.inv, union = run.slc_fwd(q, k_slc, v_slc, block_idx, o_cmp, o_win, gates, cmp_rows,
                                                        l_sel=l_sel, scale=scale, plan=plan, q_off=pos0)
        ctx.save_for_backward(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, o_cmp, o_slc, o_win,
                              lse_cmp, lse_slc, lse_win, block_idx, *union)
        ctx.hp = (l, d, l_sel, w, scale, plan, pos0, win_pos0)
        ctx.mark_non_differentiable(block_idx)
        return o, block_idx

    @staticmethod
    def backward(ctx, do, _dbi):
        (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, o_cmp, o_slc, o_win,
         lse_cmp, lse_slc, lse_win, block_idx, *union) = ctx.saved_tensors
        l, d, l_sel, w, scale, plan, pos0, win_pos0 = ctx.hp
        run, tn = ctx.run, plan.tuning
        do = do.contiguous()
        if do.data_ptr() % 16:   # the TMA walks read dO by rows: an aligned copy (same values)
            do = do.clone()
        # dgates [B,T,HQ,3] fp32, and for branches computed outside their outputs' gradients g_c * dO
        dg, do_cmp, do_win = gate_grads(do, o_cmp, o_slc, o_win, gates, run.ext_cmp, run.ext_win, ctx.cmp_rows,
                                        ctx.sums)
        dq, dkc, dvc = run.cmp_bwd(q, k_cmp, v_cmp, do, lse_cmp, dg, gates, 0, stride=d, offset=l - 1, window=0,
                                   scale=scale, dq_dtype=torch.float32, tuning=tn.attn, q_off=pos0)
        # dq accumulates in fp32 over the branches run here; the last of them writes q's dtype. With both
        # flash branches outside, the selection's dq kernels may wait for their gradients of q (QFork's
        # backward adds them in those kernels' epilogue): they go to the call's DeferredDq (dq is then None)
        later = ctx.deferred.tasks if run.fold else None
        dq, dks, dvs = run.slc_bwd(q, k_slc, v_slc, block_idx, do, lse_slc, dg[..., 1].contiguous(), gates[..., 1],
                                   l_sel=l_sel, scale=scale, chunk=plan.chunk, dq_in=dq, walk=plan.walk,
                                   dq_dtype=q.dtype if run.ext_win else torch.float32, plan=plan, later=later,
                                   inv=ctx.inv, union=union, q_off=pos0)
        dq, dkw, dvw = run.win_bwd(q, k_win, v_win, do, lse_win, dg, gates, 2, stride=1, offset=0, window=w,
                                   scale=scale, dq_in=dq, dq_dtype=q.dtype, tuning=tn.attn, q_off=pos0 - win_pos0)
        return (dq, dkc, dvc, dks, dvs, dkw, dvw, dg.to(gates.dtype), do_cmp, None, do_win,
                None, None, None, None, None, None, None, None, None, None, None, None)


# ------------------------------------------------------------------------- the steps, and the plan's tables of them

def _given(q, k, v, o_in, lse_in, **_):
    """A branch computed outside: its output (and log-sum-exp) as the Function received them."""
    return o_in.contiguous(), lse_in.contiguous()


def _given_win(q, k, v, o_in, lse_in, **_):
    """The window computed outside: its output; its log-sum-exp is flash-attn's own (not needed here)."""
    return o_in.contiguous(), o_in.new_empty(0)


def _attn_fwd(q, k, v, o_in, lse_in, **kw):
    return attn_fwd(q, k, v, **kw)


def _attn_bwd(q, k, v, do, lse, dg, gates, c: int, **kw):
    """Branch c's Triton backward: delta = its gate gradient dg[..., c] (fp32), its gate gates[..., c]."""
    return attn_bwd(q, k, v, do, lse, dg[..., c].contiguous(), gates[..., c], **kw)


def _outside_bwd(q, *args, dq_in=None, **_):
    """A branch computed outside: autograd runs its backward; dq passes through (nothing is launched here)."""
    return dq_in, None, None


def _fwd_token(q, k, v, block_idx, o_cmp, o_win, gates, cmp_rows, *, l_sel, scale, plan, q_off):
    """One program per token; q_off: its rows' position offset (the query-offset route's selection forward)."""
    o_slc, lse_slc = slc_fwd(q, k, v, block_idx, l_sel=l_sel, scale=scale, tuning=plan.tuning.select, q_off=q_off)
    return combine(o_cmp, o_slc, o_win, gates, cmp_rows), o_slc, lse_slc, None, ()


def _fwd_block(q, k, v, block_idx, o_cmp, o_win, gates, cmp_rows, *, l_sel, scale, plan, q_off=0):
    """Block order: the pair inversion it walks is the one the dK/dV walk takes, kept for it."""
    inv = invert_selection(block_idx, l_sel, plan.chunk, ranks=True)
    o_slc, lse_slc = slc_fwd_pairs(q, k, v, block_idx, inv, l_sel=l_sel, scale=scale, chunk=plan.chunk,
                                   tuning=plan.tuning.select, pairs=plan.pairs)
    return combine(o_cmp, o_slc, o_win, gates, cmp_rows), o_slc, lse_slc, inv, ()


def _tile_slc(q, k, v, block_idx, l_sel, scale, plan, fused):
    """Query tiles: the union [B,H,T/m,m*n_sel] is built once here and reused by the backward; fused: the
    gates.Combine the tile forward writes the op's output to, or None."""
    union = tile_unions(block_idx, plan.m, group=plan.tile_group, n_blocks=triton.cdiv(k.shape[1], l_sel))
    o_slc, lse_slc = slc_fwd_tile(q, k, v, block_idx, l_sel=l_sel, scale=scale, m=plan.m, union=union,
                                  tuning=plan.tuning.tile, combine=fused, gluon_stages=plan.fwd_gluon)
    return o_slc, lse_slc, union


def _fwd_tile(q, k, v, block_idx, o_cmp, o_win, gates, cmp_rows, *, l_sel, scale, plan, q_off=0):
    o_slc, lse_slc, union = _tile_slc(q, k, v, block_idx, l_sel, scale, plan, None)
    return combine(o_cmp, o_slc, o_win, gates, cmp_rows), o_slc, lse_slc, None, union


def _fwd_tile_fused(q, k, v, block_idx, o_cmp, o_win, gates, cmp_rows, *, l_sel, scale, plan, q_off=0):
    """The tile forward also writes the op's gated sum (plan.combine): no combine pass."""
    fused = Combine.of(o_cmp, o_win, gates, cmp_rows)
    o_slc, lse_slc, union = _tile_slc(q, k, v, block_idx, l_sel, scale, plan, fused)
    return fused.out, o_slc, lse_slc, None, union


def _bwd_token(q, k, v, block_idx, do, lse, delta, gate, *, plan, later, inv, union, **kw):
    """The per-token dq kernel + the dK/dV walk (inv: the block-order forward's, else None); nothing goes to later."""
    return slc_bwd(q, k, v, block_idx, do, lse, delta, gate, tuning=plan.tuning.select, inv=inv, **kw)


def _bwd_tile(q, k, v, block_idx, do, lse, delta, gate, *, plan, later, inv, union, q_off=0, **kw):
    """The tile dq kernel (Gluon with plan.dq_gluon slots) on the forward's unions + the dK/dV walk without dq."""
    return slc_bwd_tile(q, k, v, block_idx, do, lse, delta, gate, m=plan.m, union=TileUnion(*union),
                        tuning=plan.tuning.tile, select=plan.tuning.select, later=later, dq_gluon=plan.dq_gluon, **kw)


def _bwd_pairs(q, k, v, block_idx, do, lse, delta, gate, *, l_sel: int, scale: float, chunk: int, dq_in, dq_dtype,
               walk, plan, later: list | None, inv, union, q_off=0):
    """(dq, dK, dV) of the selection block by block: one dK/dV walk that also writes each (token, block)
    pair's dq partial, then their per-token sum by ranks (+ dq_in) into a dq_buffer; with `later` that sum is
    appended there as a task (qsum.DeferredDq) and dq is None. inv: the block-order forward's pair inversion,
    else made here (a per-token forward holds none)."""
    inv = inv if inv is not None else invert_selection(block_idx, l_sel, chunk, ranks=True)
    H, n_sel = k.shape[2], block_idx.shape[3]
    dqp = pair_buffer(q, n_sel, H, q.shape[-1], plan.pairs, dq=True)
    dks, dvs = slc_dkdv(q, k, v, block_idx, do, lse, delta, gate, l_sel=l_sel, scale=scale, chunk=chunk,
                        tuning=plan.tuning.select, inv=inv, dq_pairs=dqp, walk=walk)
    if later is not None:
        later.append(lambda out, add: pair_dq(q, dqp, inv, n_sel, H, dq=out, dq_in=dq_in, add=add))
        return None, dks, dvs
    return pair_dq(q, dqp, inv, n_sel, H, dq=dq_buffer(q, dq_in, dq_dtype), dq_in=dq_in), dks, dvs


# q_off: only the query-offset plan (route.offset_route) passes one, and only to _attn_fwd / _attn_bwd / the token
# steps; the block and tile steps (and the branches computed outside) are never planned with it and take 0
_CMP_FWD = MappingProxyType({False: _attn_fwd, True: _given})            # keyed by "computed outside"
_WIN_FWD = MappingProxyType({False: _attn_fwd, True: _given_win})
_ATTN_BWD = MappingProxyType({False: _attn_bwd, True: _outside_bwd})
_SLC_FWD = MappingProxyType({("token", False): _fwd_token, ("block", False): _fwd_block,   # (plan.fwd, plan.combine)
                             ("tile", False): _fwd_tile, ("tile_gluon", False): _fwd_tile,
                             ("tile", True): _fwd_tile_fused, ("tile_gluon", True): _fwd_tile_fused})
_SLC_BWD = MappingProxyType({"token": _bwd_token, "pairs": _bwd_pairs, "tile": _bwd_tile})


# ------------------------------------------------------------------- the branches computed outside the Function

def _no_cmp(*_a, **_k):
    return None, None, None


def _cmp_rows(plan, q, q_cmp, k_cmp, v_cmp, maps, bnhd, scale, sums):
    """The compressed branch as one grouped-query causal problem on the planned dense backend (cmp_dense.py):
    (o_cmp and lse_cmp in that problem's rows, their CmpMaps)."""
    o_cmp, lse_cmp = cmp_dense.cmp_attention_rows(q_cmp, k_cmp, v_cmp, maps, T=q.shape[1], HQ=q.shape[2], scale=scale,
                                                  backend=plan.cmp, bnhd=bnhd, rows_out=True, sums=sums)
    return o_cmp, lse_cmp.detach(), maps


def _no_win(*_a, **_k):
    return None


def _win_dense(plan, q, k, v, w, scale, sums):
    """flash-attn's public API (plan.win_entry "plain")."""
    return dense_attention(q, k, v, causal=True, window=w, scale=scale, backend=plan.win)


def _win_split(plan, q, k, v, w, scale, sums):
    """FA4 through its backward entry (row sums, the kept dq accumulator), split per KV head for "split"."""
    return window_split.window_attention_split(q, k, v, w, scale, plan.win, sums, plan.win_entry == "split",
                                               plan.win_gate_lse)


_CMP_OUT = MappingProxyType({False: _no_cmp, True: _cmp_rows})          # keyed by plan.cmp != "triton"
_WIN_OUT = MappingProxyType({(False, "plain"): _no_win, (True, "plain"): _win_dense,   # (plan.win != "triton", entry)
                             (True, "entry"): _win_split, (True, "split"): _win_split})


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def call_plan(q, k_cmp, v_cmp, k_slc, v_slc, *, l: int, d: int, l_sel: int, n_sel: int, w: int,
              tuning: KernelTuning | None = None, chunk: int | None = None, q_off: bool = False) -> OpPlan:
    """The plan nsa_triton_apply makes for these tensors (after their unit-stride copies): what a caller may keep
    for later calls with the same shapes, strides, alignment, grad state and q_off (pos0 > 0; eager.py keeps one
    per call signature)."""
    q, k_cmp, v_cmp, k_slc, v_slc = map(_unit, (q, k_cmp, v_cmp, k_slc, v_slc))
    return plan_call(q, k_cmp, v_cmp, k_slc, v_slc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, tuning=tuning,
                     chunk=chunk, q_off=q_off)


def nsa_triton_apply(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, *, l: int, d: int, l_sel: int,
                     n_sel: int, w: int, scale: float, dkdv_chunk: int | None = None,
                     tuning: KernelTuning | None = None, plan: OpPlan | None = None, pos0: int = 0, win_pos0: int = 0):
    """Make layouts kernel-friendly, plan the call (nsa/ops/plan.py), run the branches computed outside
    and the autograd.Function (inputs already validated). A branch the backend refuses at run time is
    planned away (plan.refuse_branch: the Triton kernel for this call and, through the registry, the next).

    tuning: launch parameters of every kernel (None: the preset of q's device).
    dkdv_chunk: queries per program in the selection dK/dV kernel (long lists are split and their
    fp32 partials added in a fixed order; None: the plan's); small values exercise that path in tests.
    plan: call_plan's for tensors of this signature, kept by the caller (None: planned here).
    pos0 / win_pos0: queries at positions pos0.. (context parallelism), as nsa_reference's: q/gates [B,T,...],
    k_slc/v_slc [B,pos0+T,...], k_win/v_win [B,pos0+T-win_pos0,...] (win_pos0 <= max(0, pos0-w+1)), k_cmp/v_cmp
    the compressed tokens before pos0+T (validate_inputs(decode=True) checks this); planned on the offset route."""
    q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = map(_unit, (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win))
    plan = plan or plan_call(q, k_cmp, v_cmp, k_slc, v_slc, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, tuning=tuning,
                             chunk=dkdv_chunk, q_off=pos0 > 0)
    assert plan.q_off or not pos0, "queries at an offset need the offset plan (call_plan(q_off=True))"
    ext_cmp, ext_win = plan.cmp != "triton", plan.win != "triton"
    bnhd = ext_cmp and cmp_dense.bnhd_layout(plan.cmp)
    maps = cmp_dense.cmp_maps(q, k_cmp, l=l, d=d, bnhd=bnhd) if ext_cmp else None
    # plan.dq_fold: both branches outside and q's gradient wanted, so q_slc below is QFork's (not q)
    deferred = DeferredDq() if plan.dq_fold else None
    # D of the flash branches from the gate gradients (branch_sums.py): their backward skips reading o
    sums = RowSums() if plan.row_sums else None
    q_cmp, q_win, q_slc = fork_q(q, maps, ext_win, deferred, sums)
    if sums is not None:   # QFork reads the branches' gradients of q: FA4's dq accumulators will do (fa4_accum.py)
        sums.keep_dq = plan.fa4_accum
    try:
        o_cmp, lse_cmp, cmp_rows = _CMP_OUT[ext_cmp](plan, q, q_cmp, k_cmp, v_cmp, maps, bnhd, scale, sums)
    except RuntimeError as exc:   # e.g. a shape this cuDNN refuses though the small probe passed
        plan, o_cmp, lse_cmp, cmp_rows = refuse_branch("cmp", q, v_cmp, plan, exc), None, None, None
    try:   # differentiable: flash-attn's own backward gets g_win * dO from the Function
        o_win = _WIN_OUT[ext_win, plan.win_entry](plan, q_win, k_win, v_win, w, scale, sums)
    except (RuntimeError, AssertionError, ValueError) as exc:   # a shape flash-attn refuses
        plan, o_win = refuse_branch("win", q, v_win, plan, exc), None
    return NSATritonFunction.apply(q_slc, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates.contiguous(), o_cmp,
                                   lse_cmp, o_win, cmp_rows, l, d, l_sel, n_sel, w, scale, plan, sums, deferred, pos0,
                                   win_pos0)
