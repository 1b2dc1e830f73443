"""The selection's dK/dV walk in Gluon (Triton's explicit-layout dialect) for Hopper, with or without dq pair
partials: select._slc_bwd_dkdv_kernel's contract, the same programs and arithmetic in the same order (its
dK / dV / partials are bitwise the Triton walk's: tests/test_triton_tile_gluon.py).

One program per work item (segment = (b, h, block j), chunk of its token list). The block's K / V tiles come
by TMA once; each step's q / dO rows (QB tokens x G heads = 64 rows, one [G, d] box per token) arrive by TMA
into a ring of mbarrier-guarded slots filled a step ahead. Without dq partials the rows' token ids are read two
steps ahead and their lse / delta / gate one, so no step
waits on a dependent gather; with them (where the prefetch would spill 12 B more) the ids are read one step ahead
and the row values at the step's start.

Eligible (nsa/ops/plan.py, _walk): the Gluon tile kernels' conditions (Hopper, bf16 / fp16, d = 128, l_sel = 64,
K / V as 2-D [B*T, H*d]) with 64 rows of whole tokens' heads per step and q / dO as [B*T*HQ, d]. A failure to
build or launch turns the Gluon kernels off for the device (tile_gluon._launch). Gluon has no interpreter:
tests/test_triton_tile_gluon.py compiles the walk for sm_90 on the CPU and compares it bitwise with the Triton
walk on a GPU.
"""
from __future__ import annotations

import functools

import torch

from .tile_gluon import LSEL, _descriptors, _launch

ROWS = 64          # wgmma rows of one warpgroup: a walk step's rows must be exactly this
# the walk's dq partial in DQC column slices of d: sm_90 spill stores 200 / 52 / 60 B at 1 / 2 / 4 (Triton 3.6,
# before the token-id prefetch, which adds 16 B)
_DQC = 2


@functools.lru_cache(maxsize=None)
def _walk_kernel():
    """The @gluon.jit walk, built on first use (CPU-only runs never import Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # Gluon is experimental: the TMA load was async_copy_global_to_shared up to Triton 3.6, async_load later
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier      # renamed likewise

    @gluon.jit
    def _step_toks(TOKS, e0, end, QB: gl.constexpr, num_warps: gl.constexpr):
        """The token ids of list entries e0 .. e0+QB-1 (past `end`: token 0, masked later) as an int32 [QB]
        that every thread holds whole."""
        iq = gl.arange(0, QB, layout=gl.BlockedLayout([QB], [32], [num_warps], [0]))
        return gl.load(TOKS + e0 + iq, mask=e0 + iq < end, other=0).to(gl.int32)

    @gluon.jit
    def _load_rows(q_desc, do_desc, bar, qs, dos, toks, row_b, hq0, HQ, G: gl.constexpr, QB: gl.constexpr):
        """One walk step's rows into a ring slot: for each of its QB tokens (toks, _step_toks) the token's
        G head rows of q and dO, one [G, d] TMA box each."""
        mbarrier.expect(bar, QB * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
        iq = gl.arange(0, QB, layout=toks.type.layout)
        for r in gl.static_range(QB):
            t = gl.sum(gl.where(iq == r, toks, 0), 0)   # within each thread: it holds all QB
            row = (row_b + t) * HQ + hq0          # TMA coordinates are int32 (B*T*HQ < 2**31, checked)
            tma_load(q_desc, [row, 0], bar, qs.slice(r * G, G))
            tma_load(do_desc, [row, 0], bar, dos.slice(r * G, G))

    @gluon.jit
    def _row_vals(LSE, DELTA, GATE, row_b, toks, ok, hq, HQ, sgt, HAS_GATE: gl.constexpr):
        """A walk step's per-row lse (log2 units), delta and gate: rows of tokens toks (int32) x query heads hq."""
        ridx = (row_b.to(gl.int64) + toks.to(gl.int64)) * HQ + hq
        lse = gl.load(LSE + ridx, mask=ok, other=0.0) * 1.4426950408889634
        delta = gl.load(DELTA + ridx, mask=ok, other=0.0)
        if HAS_GATE:
            gate = gl.load(GATE + ridx * sgt, mask=ok, other=0.0).to(gl.float32)
        else:
            gate = gl.full(lse.shape, 1.0, gl.float32, layout=lse.type.layout)
        return lse, delta, gate

    @gluon.jit
    def _gwalk_dkdv(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, GATE, TOKS, SEGOFF, WSEG, WCHUNK, XOFF,
                    DKO, DVO, XDK, XDV, DQP, sgt, T, H, NSB, NSEG, scale_log2, scale,
                    G: gl.constexpr, QB: gl.constexpr, LS: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                    CH: gl.constexpr, NSTAGE: gl.constexpr, HAS_GATE: gl.constexpr, DQ_PAIRS: gl.constexpr,
                    DQC: gl.constexpr, ROW_PF: gl.constexpr, num_warps: gl.constexpr):
        """select._slc_bwd_dkdv_kernel with rows on the MMA's M side, operation for operation: one program
        per work item (segment = (b, h, block j), chunk of its token list); the block's K / V by TMA once;
        each step's q / dO rows (QB tokens x G heads) by TMA into a ring. DQ_PAIRS: also each (token, block)
        pair's dq partial dS K * scale [G, d] at the pair's list position (select._store_dq_pairs)."""
        R: gl.constexpr = G * QB
        w = gl.program_id(0)
        seg = gl.load(WSEG + w).to(gl.int32)     # as select.work_item, in int32 (TMA coordinates)
        chunk = gl.load(WCHUNK + w).to(gl.int32)
        ok = seg < NSEG
        seg = gl.where(ok, seg, 0)
        j = seg % NSB
        bh = seg // NSB
        b = bh // H
        h = bh % H
        start = (gl.load(SEGOFF + seg) + chunk * CH).to(gl.int32)
        end = gl.where(ok, gl.minimum(gl.load(SEGOFF + seg + 1), start + CH), start).to(gl.int32)
        HQ = H * G
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, LS, 16])
        mma_k: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        mma_h: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D // DQC, 16])
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, LS], k_desc.dtype)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [LS, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [LS, DV], v_desc.layout)
        q_ring = gl.allocate_shared_memory(q_desc.dtype, [NSTAGE, R, D], q_desc.layout)
        do_ring = gl.allocate_shared_memory(do_desc.dtype, [NSTAGE, R, DV], do_desc.layout)
        p_smem = gl.allocate_shared_memory(k_desc.dtype, [R, LS], p_sl)
        ds_smem = gl.allocate_shared_memory(k_desc.dtype, [R, LS], p_sl)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(NSTAGE):
            mbarrier.init(bars.index(i), count=1)
        row_b = b * T
        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [row_b + j * LS, h * D], kv_bar, k_smem)
        tma_load(v_desc, [row_b + j * LS, h * DV], kv_bar, v_smem)
        nsteps = (end - start + QB - 1) // QB
        for i in gl.static_range(NSTAGE - 1):
            if i < nsteps:
                _load_rows(q_desc, do_desc, bars.index(i), q_ring.index(i), do_ring.index(i),
                           _step_toks(TOKS, start + i * QB, end, QB, num_warps), row_b, h * G, HQ, G, QB)
        rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma_s))
        kk = gl.arange(0, LS, layout=gl.SliceLayout(0, mma_s))
        s_zero = gl.zeros([R, LS], gl.float32, layout=mma_s)
        dk = gl.zeros([LS, D], gl.float32, layout=mma_k)
        dv = gl.zeros([LS, DV], gl.float32, layout=mma_k)
        # token ids are read ahead of their use, the rows' (for the lse / delta / gate gathers: two steps with
        # ROW_PF, whose row values then come a step ahead, else one) and the next refill's (for its TMA
        # coordinates): none then waits on a dependent global load
        e = start + rs // G
        t_next = gl.load(TOKS + e, mask=e < end, other=0).to(gl.int32)                 # [R], step 0
        toks_r = _step_toks(TOKS, start + (NSTAGE - 1) * QB, end, QB, num_warps)      # [QB], the first refill
        if ROW_PF:   # the rows' lse / delta / gate a step ahead too (token ids two): no gather waits in a step
            t_cur = t_next
            lse_n, delta_n, gate_n = _row_vals(LSE, DELTA, GATE, row_b, t_cur, e < end, h * G + rs % G, HQ, sgt,
                                               HAS_GATE)
            t_next = gl.load(TOKS + e + QB, mask=e + QB < end, other=0).to(gl.int32)  # [R], step 1
        mbarrier.wait(kv_bar, phase=0)
        for st in range(nsteps):
            nxt = st + NSTAGE - 1
            if nxt < nsteps:   # refill the slot step st-1 read (the barrier: every warp is past its waits)
                cta_barrier()
                s2 = nxt % NSTAGE
                _load_rows(q_desc, do_desc, bars.index(s2), q_ring.index(s2), do_ring.index(s2), toks_r, row_b, h * G,
                           HQ, G, QB)
            toks_r = _step_toks(TOKS, start + (nxt + 1) * QB, end, QB, num_warps)
            slot = st % NSTAGE
            qs = q_ring.index(slot)
            dos = do_ring.index(slot)
            e = start + st * QB + rs // G
            row_ok = e < end
            if ROW_PF:   # this step's values arrived a step ago; t_next holds step st+1's tokens
                t32 = t_cur
                lse, delta, gate = lse_n, delta_n, gate_n
                lse_n, delta_n, gate_n = _row_vals(LSE, DELTA, GATE, row_b, t_next, e + QB < end, h * G + rs % G,
                                                   HQ, sgt, HAS_GATE)
                t_cur = t_next
                t_next = gl.load(TOKS + e + 2 * QB, mask=e + 2 * QB < end, other=0).to(gl.int32)
            else:
                t32 = t_next
                t_next = gl.load(TOKS + e + QB, mask=e + QB < end, other=0).to(gl.int32)
                lse, delta, gate = _row_vals(LSE, DELTA, GATE, row_b, t32, row_ok, h * G + rs % G, HQ, sgt, HAS_GATE)
            t = t32.to(gl.int64)
            limit = gl.where(row_ok, gl.minimum(t - j * LS, LS - 1), -1).to(gl.int32)   # select.walk_limit
            mbarrier.wait(bars.index(slot), phase=(st // NSTAGE) & 1)
            sacc = warpgroup_mma(qs, k_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpa = warpgroup_mma(dos, v_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sacc, dpa = warpgroup_mma_wait(num_outstanding=0, deps=(sacc, dpa))
            vis = kk[None, :] <= limit[:, None]
            p = gl.where(vis, gl.exp2(sacc * scale_log2 - lse[:, None]), 0.0) * gate[:, None]
            ds = p * (dpa - delta[:, None])
            p_smem.store(p.to(k_desc.dtype))
            ds_smem.store(ds.to(k_desc.dtype))
            fence_async_shared()
            cta_barrier()
            dv = warpgroup_mma(p_smem.permute((1, 0)), dos, dv, is_async=True)
            dk = warpgroup_mma(ds_smem.permute((1, 0)), qs, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            if DQ_PAIRS:   # dS K * scale [R, d] in DQC column slices of d (fewer accumulator registers beside dK / dV)
                rq = gl.arange(0, R, layout=gl.SliceLayout(1, mma_h))
                eq = start + st * QB + rq // G
                pr = eq.to(gl.int64) * G + rq % G
                for c in gl.static_range(DQC):
                    dqp = warpgroup_mma(ds_smem, k_smem.slice(c * (D // DQC), D // DQC, dim=1),
                                        gl.zeros([R, D // DQC], gl.float32, layout=mma_h), use_acc=False)
                    cq = c * (D // DQC) + gl.arange(0, D // DQC, layout=gl.SliceLayout(0, mma_h))
                    gl.store(DQP + pr[:, None] * D + cq[None, :], (dqp * scale).to(DQP.dtype.element_ty),
                             mask=(eq < end)[:, None])
        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(NSTAGE):
            mbarrier.invalidate(bars.index(i))
        dk = dk * scale
        ko = gl.arange(0, LS, layout=gl.SliceLayout(1, mma_k))
        co = gl.arange(0, D, layout=gl.SliceLayout(0, mma_k))
        first = ok & (chunk == 0) & (ko < gl.minimum(T - j * LS, LS))
        o_row = ((row_b.to(gl.int64) + j * LS + ko) * H + h)
        gl.store(DKO + o_row[:, None] * D + co[None, :], dk, mask=first[:, None])
        gl.store(DVO + o_row[:, None] * DV + co[None, :], dv, mask=first[:, None])
        extra = ok & (chunk > 0) & (ko < LS)
        xslot = gl.load(XOFF + seg) + chunk - 1
        x_row = (gl.where(extra, xslot, 0) * LS + ko).to(gl.int64)
        gl.store(XDK + x_row[:, None] * D + co[None, :], dk, mask=extra[:, None])
        gl.store(XDV + x_row[:, None] * DV + co[None, :], dv, mask=extra[:, None])


    return _gwalk_dkdv


def gwalk_dkdv(q, k, v, do, lse, delta, gate_arg, sgt: int, inv: dict, dk32, dv32, xdk, xdv, *, chunk: int,
               scale: float, stages: int, has_gate: bool, dq_pairs: torch.Tensor | None = None) -> bool:
    """select.slc_dkdv's walk for inputs the plan gives the Gluon walk: fills dk32 / dv32 / xdk / xdv as
    _slc_bwd_dkdv_kernel does (reduce_dkdv sums them), and with dq_pairs [P*G, d] each pair's dq partial
    there (without them the rows' values come a step ahead). False as gtile_fwd's."""
    return _launch("the Gluon dK/dV walk", q, lambda: _walk(q, k, v, do, lse, delta, gate_arg, sgt, inv, dk32, dv32,
                                                            xdk, xdv, dq_pairs, chunk, scale, stages, has_gate,
                                                            dq_pairs is None))


def _walk(q, k, v, do, lse, delta, gate_arg, sgt, inv, dk32, dv32, xdk, xdv, dq_pairs, chunk, scale, stages,
          has_gate, row_pf) -> None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[3]
    G = HQ // H
    kd, vd = _descriptors(k, v)
    dt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for([G, D], dt)
    qd = TensorDescriptor(q, [B * T * HQ, D], [D, 1], [G, D], lay)
    dod = TensorDescriptor(do, [B * T * HQ, DV], [DV, 1], [G, DV], lay)
    _walk_kernel()[(inv["w_max"],)](qd, dod, kd, vd, lse, delta, gate_arg, inv["toks"], inv["segoff"], inv["wseg"],
                                  inv["wchunk"], inv["xoff"], dk32, dv32, xdk, xdv,
                                  dk32 if dq_pairs is None else dq_pairs, sgt, T, H, inv["nsb"], inv["nseg"],
                                  scale * 1.4426950408889634, scale, G=G, QB=ROWS // G, LS=LSEL, D=D, DV=DV, CH=chunk,
                                  NSTAGE=stages, HAS_GATE=has_gate, DQ_PAIRS=dq_pairs is not None, DQC=_DQC,
                                  ROW_PF=row_pf, num_warps=4)
