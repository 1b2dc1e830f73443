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

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import fallbacks
from ..flash import dense_attention
from .. import window_split
from ..branch_sums import RowSums
from ..plan import OpPlan, plan_call
from ..tuning import KernelTuning
from . import cmp_dense
from ._utils import next_pow2
from .attn import attn_bwd, attn_fwd
from .scores import select_blocks
from .select import dq_buffer, invert_selection, slc_bwd, slc_dkdv, slc_fwd
from .select_block import pair_buffer, pair_dq, slc_fwd_pairs
from .select_tile import TileUnion, slc_bwd_tile, slc_fwd_tile, tile_unions
from .qsum import DeferredDq, QFork


@triton.jit
def _cmp_rows(r, ok, SLOT, n_per_b, s_rows, DV: tl.constexpr, ROWS: tl.constexpr):
    """(element offset of o_cmp's row for q rows r [BLOCK] (flattened b, t, hq), valid mask): r itself,
    or with ROWS the dense compressed problem's row SLOT[t*HQ + hq] of batch b (invalid where -1:
    nothing visible, o_cmp = 0)."""
    if ROWS:
        b = r // n_per_b
        slot = tl.load(SLOT + (r - b * n_per_b), mask=ok, other=-1)
        return (b * s_rows + slot) * DV, ok & (slot >= 0)
    return r * DV, ok


@triton.jit
def _combine_fwd_kernel(OC, OS, OW, GT, O, SLOT, n_per_b, n_rows, s_rows, DV: tl.constexpr, BDV: tl.constexpr,
                        BLOCK: tl.constexpr, SUB: tl.constexpr, ROWS: tl.constexpr):
    """o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win over rows [n_rows, DV] (o_cmp's rows: _cmp_rows),
    SUB blocks of BLOCK rows per program (fewer programs to start)."""
    c = tl.arange(0, BDV)
    cm = c[None, :] < DV
    for i in tl.static_range(SUB):
        r = ((tl.program_id(0) * SUB + i) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = r < n_rows
        m = ok[:, None] & cm
        off = r[:, None] * DV + c[None, :]
        oc_row, oc_ok = _cmp_rows(r, ok, SLOT, n_per_b, s_rows, DV, ROWS)
        g0 = tl.load(GT + r * 3, mask=ok, other=0.0).to(tl.float32)
        g1 = tl.load(GT + r * 3 + 1, mask=ok, other=0.0).to(tl.float32)
        g2 = tl.load(GT + r * 3 + 2, mask=ok, other=0.0).to(tl.float32)
        o = g0[:, None] * tl.load(OC + oc_row[:, None] + c[None, :], mask=oc_ok[:, None] & cm,
                                  other=0.0).to(tl.float32)
        o += g1[:, None] * tl.load(OS + off, mask=m, other=0.0).to(tl.float32)
        o += g2[:, None] * tl.load(OW + off, mask=m, other=0.0).to(tl.float32)
        tl.store(O + off, o.to(O.dtype.element_ty), mask=m)


@triton.jit
def _gate_bwd_kernel(DO, OC, OS, OW, DG, GT, DOC, DOW, SLOT, DLC, LSLOT, n_per_b, n_rows, s_rows, DV: tl.constexpr,
                     BDV: tl.constexpr, BLOCK: tl.constexpr, WRITE_DOC: tl.constexpr, WRITE_DOW: tl.constexpr,
                     ROWS: tl.constexpr, WRITE_DLC: tl.constexpr):
    """dg[r, c] = sum_v dO[r, v] * o_c[r, v] (fp32); with WRITE_DOC also dO_cmp = g_cmp * dO (into o_cmp's
    row, _cmp_rows), with WRITE_DOW dO_win = g_win * dO (the gradients of branch outputs computed
    outside, in dO's dtype), from the same read. WRITE_DLC (with ROWS): also D = g_cmp * dg_cmp at the
    dense problem's lse index LSLOT[t*HQ + hq] of batch b in DLC [B, s_rows] (branch_sums.py)."""
    r = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    ok = r < n_rows
    c = tl.arange(0, BDV)
    cm = c[None, :] < DV
    m = ok[:, None] & cm
    off = r[:, None] * DV + c[None, :]
    oc_row, oc_ok = _cmp_rows(r, ok, SLOT, n_per_b, s_rows, DV, ROWS)
    oc = oc_row[:, None] + c[None, :]
    do = tl.load(DO + off, mask=m, other=0.0).to(tl.float32)
    if WRITE_DOC:
        g0 = tl.load(GT + r * 3, mask=ok, other=0.0).to(tl.float32)
        tl.store(DOC + oc, (g0[:, None] * do).to(DOC.dtype.element_ty), mask=oc_ok[:, None] & cm)
    if WRITE_DOW:
        g2 = tl.load(GT + r * 3 + 2, mask=ok, other=0.0).to(tl.float32)
        tl.store(DOW + off, (g2[:, None] * do).to(DOW.dtype.element_ty), mask=m)
    dg0 = tl.sum(do * tl.load(OC + oc, mask=oc_ok[:, None] & cm, other=0.0).to(tl.float32), 1)
    tl.store(DG + r * 3, dg0, mask=ok)
    if WRITE_DLC:
        b = r // n_per_b
        ls = tl.load(LSLOT + (r - b * n_per_b), mask=ok, other=-1)
        gd = tl.load(GT + r * 3, mask=ok, other=0.0).to(tl.float32)
        tl.store(DLC + b * s_rows + ls, gd * dg0, mask=ok & (ls >= 0))
    tl.store(DG + r * 3 + 1, tl.sum(do * tl.load(OS + off, mask=m, other=0.0).to(tl.float32), 1), mask=ok)
    tl.store(DG + r * 3 + 2, tl.sum(do * tl.load(OW + off, mask=m, other=0.0).to(tl.float32), 1), mask=ok)


def _rows_grid(n_rows: int, dv: int) -> tuple[int, int, int]:
    bdv = max(16, next_pow2(dv))
    block = max(1, min(64, 2048 // bdv))   # small tiles: 3 operand tiles stay in registers
    return triton.cdiv(n_rows, block), bdv, block


def _rows_args(cmp_rows: cmp_dense.CmpMaps | None, other: torch.Tensor) -> tuple:
    """(SLOT, n_per_b) kernel arguments of _cmp_rows: the dense problem's row_slot and its length, or
    (any valid pointer, 1) when o_cmp is in q's rows."""
    return (cmp_rows.row_slot, cmp_rows.row_slot.numel()) if cmp_rows is not None else (other, 1)


COMBINE_SUB = 4   # row blocks per combine program


def combine(o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor,
            cmp_rows: cmp_dense.CmpMaps | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """All contiguous: o_* [B,T,HQ,dv] (o_cmp [B,S,dv] in the dense problem's rows with cmp_rows),
    gates [B,T,HQ,3] -> o [B,T,HQ,dv] in o_slc's dtype (into out when given)."""
    o = torch.empty_like(o_slc) if out is None else out
    n_rows, dv = o.numel() // o.shape[-1], o.shape[-1]
    if n_rows == 0:
        return o
    nb, bdv, block = _rows_grid(n_rows, dv)
    slot, n_per_b = _rows_args(cmp_rows, o)
    _combine_fwd_kernel[(triton.cdiv(nb, COMBINE_SUB),)](
        o_cmp, o_slc, o_win, gates, o, slot, n_per_b, n_rows, o_cmp.shape[1], DV=dv, BDV=bdv, BLOCK=block,
        SUB=COMBINE_SUB, ROWS=cmp_rows is not None)
    return o


class Combine(NamedTuple):
    """The op's output o [B,T,HQ,dv] = the gated sum of the branches (combine()), for a selection forward
    that writes it from its own rows (select_tile.slc_fwd_tile's combine): the other operands and, for
    o_cmp in the dense compressed problem's rows (rows), that problem's row map (slot, n_per_b = its
    length per batch, s_rows = o_cmp's rows per batch)."""
    gates: torch.Tensor
    o_cmp: torch.Tensor
    o_win: torch.Tensor
    out: torch.Tensor
    slot: torch.Tensor
    n_per_b: int
    s_rows: int
    cmp_rows: cmp_dense.CmpMaps | None

    @property
    def rows(self) -> bool:
        return self.cmp_rows is not None

    @staticmethod
    def of(o_cmp, o_win, gates, cmp_rows: cmp_dense.CmpMaps | None) -> "Combine":
        out = torch.empty_like(o_win)
        slot, n_per_b = _rows_args(cmp_rows, out)
        return Combine(gates, o_cmp, o_win, out, slot, n_per_b, o_cmp.shape[1], cmp_rows)

    def run(self, o_slc: torch.Tensor) -> None:
        """The combine kernel into out (what the fused epilogue would have written)."""
        combine(self.o_cmp, o_slc, self.o_win, self.gates, self.cmp_rows, out=self.out)


def gate_grads(do: torch.Tensor, o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor,
               gates: torch.Tensor, ext_cmp: bool = False, ext_win: bool = False,
               cmp_rows: cmp_dense.CmpMaps | None = None, sums: RowSums | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dgates fp32 [B,T,HQ,3] = rowsum(dO * o_c); inputs contiguous, gates [B,T,HQ,3]. Also returns
    g_cmp * dO (ext_cmp; shaped like o_cmp, in the dense problem's rows with cmp_rows, whose pad rows
    get zeros) and g_win * dO (ext_win) in dO's dtype, else None: the gradients of branch
    outputs computed outside the Function. sums: also D = g_c * dg_c of those branches into its slots, in
    their lse layouts (cmp [B, HQ', N] with cmp_rows, win [B, HQ, T]; branch_sums.py). Where the window
    asked for its gate in its lse ("win_shift" in sums.wants), dO itself is its gradient, D = dg_win and
    ln g_win goes into sums.win_shift (window_split.py)."""
    dg = torch.empty(*do.shape[:-1], 3, device=do.device, dtype=torch.float32)
    doc = torch.empty(o_cmp.shape, device=do.device, dtype=do.dtype) if ext_cmp else None
    win_gate = ext_win and sums is not None and "win_shift" in sums.wants
    dow = do if win_gate else torch.empty_like(do) if ext_win else None
    n_rows, dv = do.numel() // do.shape[-1], do.shape[-1]
    if ext_cmp and cmp_rows is not None and cmp_rows.pad_rows.numel():   # rows no query maps to: dO = 0
        doc.index_fill_(1, cmp_rows.pad_rows, 0)
    dlc = None
    if sums is not None and "cmp" in sums.wants and ext_cmp and cmp_rows is not None:   # pad rows, t < l-1: D = 0
        dlc = torch.zeros(o_cmp.shape[:2], device=do.device, dtype=torch.float32)
    if n_rows:
        nb, bdv, block = _rows_grid(n_rows, dv)
        slot, n_per_b = _rows_args(cmp_rows, do)
        _gate_bwd_kernel[(nb,)](do, o_cmp, o_slc, o_win, dg, gates, doc if ext_cmp else do, dow if ext_win else do,
                                slot, dg if dlc is None else dlc, cmp_rows.lse_slot if dlc is not None else slot,
                                n_per_b, n_rows, o_cmp.shape[1], DV=dv, BDV=bdv, BLOCK=block,
                                WRITE_DOC=ext_cmp, WRITE_DOW=ext_win and not win_gate, ROWS=cmp_rows is not None,
                                WRITE_DLC=dlc is not None)
    if dlc is not None:   # [B, HQ' * N]: the branch views it as its lse [B, HQ', N]
        sums.cmp = dlc
    if win_gate:   # [B, T, HQ] -> lse's [B, HQ, T]
        sums.win = dg[..., 2].transpose(1, 2).contiguous()
        sums.win_shift = gates[..., 2].float().log().transpose(1, 2).contiguous()
    elif sums is not None and "win" in sums.wants and ext_win:
        sums.win = (dg[..., 2] * gates[..., 2].float()).transpose(1, 2).contiguous()
    return dg, doc, dow


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
        # also for T < l (no compressed token): lse_cmp is -inf there, every score is 0
        block_idx = select_blocks(q, k_cmp, lse_cmp, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=scale,
                                  tuning=tn.scores, gluon=plan.scores == "gluon")
        if ctx.ext_win:   # computed outside (flash-attn): its own autograd node owns q/k_win/v_win's grads
            o_win, lse_win = o_win_in.contiguous(), o_win_in.new_empty(0)
        else:   # before the selection, whose forward may write the op's output (Combine)
            o_win, lse_win = attn_fwd(q, k_win, v_win, stride=1, offset=0, window=w, scale=scale, tuning=tn.attn)
        # block-order forward: the pair inversion it walks is the one the dK/dV kernel walks, kept for it;
        # dq from pair partials after a per-token forward makes it in the backward (nothing held between)
        ctx.inv = inv = invert_selection(block_idx, l_sel, chunk, ranks=True) if plan.fwd == "block" else None
        union = ()
        if plan.m > 1:   # query tiles: the union [B,H,T/m,m*n_sel] is built once here and reused by the backward
            fused = Combine.of(o_cmp, o_win, gates, cmp_rows) if plan.combine else None
            union = tile_unions(block_idx, plan.m, group=tn.tile.group, n_blocks=triton.cdiv(k_slc.shape[1], l_sel))
            o_slc, lse_slc = slc_fwd_tile(q, k_slc, v_slc, block_idx, l_sel=l_sel, scale=scale, m=plan.m, union=union,
                                          tuning=tn.tile, combine=fused, gluon_stages=plan.fwd_gluon)
            o = fused.out if fused is not None else combine(o_cmp, o_slc, o_win, gates, cmp_rows)
        else:
            o_slc, lse_slc = slc_fwd_pairs(q, k_slc, v_slc, block_idx, inv, l_sel=l_sel, scale=scale, chunk=chunk,
                                           tuning=tn.select) if inv is not None else \
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
            dq, dks, dvs = _slc_bwd_pairs(inv, *args, tuning=tn.select, later=later, **kw)
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
                   dq_in, tuning, walk, dq_dtype=None, later: list | None = None):
    """(dq, dK, dV) of the selection block by block: one dK/dV walk that also writes each (token, block)
    pair's dq partial, then their per-token sum (+ dq_in) into a dq_buffer; with `later` that sum is
    appended there as a task (qsum.DeferredDq) and dq is None."""
    H, n_sel = k.shape[2], block_idx.shape[3]
    dqp = pair_buffer(q, n_sel, H, q.shape[-1], tuning, dq=True)
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
    q_cmp, q_win, q_slc = _fork(q, maps, ext_win, deferred, sums)
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
            _refuse_branch("cmp", q, v_cmp, plan.cmp, exc)
            o_cmp = lse_cmp = None
    if ext_win:
        try:   # differentiable: flash-attn's own backward gets g_win * dO from the Function
            if plan.win_entry != "plain":
                o_win = window_split.window_attention_split(q_win, k_win, v_win, w, scale, plan.win, sums,
                                                            plan.win_entry == "split", plan.win_gate_lse)
            else:
                o_win = dense_attention(q_win, k_win, v_win, causal=True, window=w, scale=scale, backend=plan.win)
        except (RuntimeError, AssertionError, ValueError) as exc:   # a shape flash-attn refuses
            _refuse_branch("win", q, v_win, plan.win, exc)
    return NSATritonFunction.apply(q_slc, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates.contiguous(), o_cmp,
                                   lse_cmp, o_win, cmp_rows, l, d, l_sel, n_sel, w, scale, plan, sums,
                                   deferred if q_slc is not q else None)


def _fork(q: torch.Tensor, maps: cmp_dense.CmpMaps | None, win: bool, deferred: DeferredDq | None = None,
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


def _refuse_branch(branch: str, q: torch.Tensor, v: torch.Tensor, be: str, exc: Exception) -> None:
    """A flash / dense backend failed on this call: refused for this device / dtype / head sizes (the planner
    plans it away from now on), counted and warned once; inside a CUDA-graph capture the error stands."""
    import warnings

    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise exc
    why = f"{be} failed at T={q.shape[1]}: {type(exc).__name__}: {str(exc)[:120]}"
    dev, dk, dv = str(q.device), q.shape[-1], v.shape[-1]
    if branch == "win":
        path, key, name, then = "win_flash", (dev, q.dtype, dk), f"win_flash:{be}->triton", "the Triton kernel"
    elif be in ("fa4", "fa2"):   # flash-attn refused: the SDPA choice (cmp_dense.mode) from now on
        path, key, name, then = f"cmp_flash:{be}", (dev, q.dtype, dk, dv), f"cmp_dense:{be}->sdpa", "SDPA / Triton"
    else:
        path, key, name, then = "cmp_sdpa", (dev, q.dtype, dk, dv), f"cmp_dense:{be}->triton", "the Triton kernel"
    fallbacks.count_fallback(name)
    fallbacks.refuse(path, key, why)
    label = "window branch" if branch == "win" else "compressed branch"
    warnings.warn(f"{label}: {why}; using {then} from now on", RuntimeWarning, stacklevel=3)
