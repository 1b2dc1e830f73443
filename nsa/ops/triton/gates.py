"""The three branches' gates: the gated sum of their outputs (combine, or the tile forward's epilogue through
Combine) and its backward, dgates = rowsum(dO * o_c) in fp32 with the branches' dO (gate_grads).

o_cmp may live in the dense compressed problem's rows (cmp_dense.CmpMaps, read through _cmp_rows); inputs are
contiguous [B, T, HQ, dv], gates [B, T, HQ, 3].
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..branch_sums import RowSums
from . import cmp_dense
from ._utils import next_pow2


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
        B, T, HQ = gates.shape[:3]   # ln of the fp32 gate, cast and laid out [B, HQ, T] in one copy
        sums.win_shift = gates.new_empty(B, HQ, T, dtype=torch.float32).copy_(gates[..., 2].transpose(1, 2)).log_()
    elif sums is not None and "win" in sums.wants and ext_win:
        sums.win = (dg[..., 2] * gates[..., 2].float()).transpose(1, 2).contiguous()
    return dg, doc, dow
