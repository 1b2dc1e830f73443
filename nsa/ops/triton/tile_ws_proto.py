"""Prototype: the Gluon tile forward with NC consumer warpgroups sharing one K/V ring (the union of NC*4
tokens, each block loaded once) and a producer warp; each consumer computes exactly the m=4 tile of its 4
tokens (skips the union entries none of its tokens chose), so o / lse must be bitwise gtile_fwd's at m=4."""
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
G = gl.constexpr(16)
M = gl.constexpr(4)
LS = gl.constexpr(64)
D = gl.constexpr(128)
DV = gl.constexpr(128)
import os as _os
NC = gl.constexpr(int(_os.environ.get("WS_NC", "2")))
NSTAGE = gl.constexpr(int(_os.environ.get("WS_STAGES", "4")))


@gluon.jit
def _consumer(Q, k_smem, v_smem, full, empty, UB, UBITS, O, LSE, sqb, sqt, sqh, sob, sot, soh, b, h, nw, w, ubase, nu,
              T, H, scale_log2):
    R: gl.constexpr = G * M
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, LS, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, R, layout=gl.SliceLayout(1, ld))
    c = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    t = (nw * M + r // G).to(gl.int64)
    x = gl.load(Q + b.to(gl.int64) * sqb + t[:, None] * sqt + (h * G + r % G)[:, None] * sqh + c[None, :],
                mask=(t < T)[:, None], other=0.0)
    qa = gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
    rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma_s))
    ti = rs // G
    tok = nw * M + ti
    kk = gl.arange(0, LS, layout=gl.SliceLayout(0, mma_s))
    m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
    l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(1, mma_s))
    acc = gl.zeros([R, DV], gl.float32, layout=mma_o)
    s_zero = gl.zeros([R, LS], gl.float32, layout=mma_s)
    for it in range(nu):
        slot = it % NSTAGE
        mbarrier.wait(full.index(slot), phase=(it // NSTAGE) & 1)
        j = gl.load(UB + ubase + it)
        bits = (gl.load(UBITS + ubase + it) >> (w * M)) & ((1 << M) - 1)
        if bits != 0:
            sacc = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sacc = warpgroup_mma_wait(num_outstanding=0, deps=(sacc, ))
            kp = j * LS + kk
            vis = (((bits >> ti) & 1) != 0)[:, None] & (kp[None, :] <= tok[:, None])
            sc = gl.where(vis, sacc * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(sc - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            pa = gl.convert_layout(p.to(Q.dtype.element_ty), gl.DotOperandLayout(operand_index=0, parent=mma_o,
                                                                                  k_width=2))
            acc = warpgroup_mma(pa, v_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            m_i = m_new
        mbarrier.arrive(empty.index(slot), count=1)
    has = l_i > 0.0
    lsafe = gl.where(has, l_i, 1.0)
    o = acc / gl.convert_layout(lsafe, gl.SliceLayout(1, mma_o))[:, None]
    lse = gl.where(has, (m_i + gl.log2(lsafe)) / 1.4426950408889634, float("-inf"))
    gl.store(LSE + (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G, lse, mask=tok < T)
    ro = gl.arange(0, R, layout=gl.SliceLayout(1, mma_o))
    co = gl.arange(0, DV, layout=gl.SliceLayout(0, mma_o))
    to = nw * M + ro // G
    gl.store(O + b.to(gl.int64) * sob + to.to(gl.int64)[:, None] * sot + (h * G + ro % G)[:, None] * soh
             + co[None, :], o.to(O.dtype.element_ty), mask=(to < T)[:, None])


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, full, empty, UB, ubase, nu, row0, h):
    for it in range(nu):
        slot = it % NSTAGE
        mbarrier.wait(empty.index(slot), phase=((it // NSTAGE) & 1) ^ 1)
        j = gl.load(UB + ubase + it)
        mbarrier.expect(full.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [row0 + j * LS, h * D], full.index(slot), k_smem.index(slot))
        tma_load(v_desc, [row0 + j * LS, h * DV], full.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_fwd(Q, k_desc, v_desc, UB, UBITS, USZ, O, LSE, sqb, sqt, sqh, sob, sot, soh, T, H, NT, scale_log2,
            UW: gl.constexpr, CREGS: gl.constexpr, num_warps: gl.constexpr):
    n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    ubase = (pid_bh.to(gl.int64) * NT + n) * UW
    nu = gl.load(USZ + pid_bh.to(gl.int64) * NT + n)
    row0 = b * T
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NSTAGE, LS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NSTAGE, LS, DV], v_desc.layout)
    full = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NSTAGE):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=NC)
    cargs = (Q, k_smem, v_smem, full, empty, UB, UBITS, O, LSE, sqb, sqt, sqh, sob, sot, soh, b, h)
    tail = (ubase, nu, T, H, scale_log2)
    prod = (k_desc, v_desc, k_smem, v_smem, full, empty, UB, ubase, nu, row0, h)
    if NC == 2:
        gl.warp_specialize([(_consumer, cargs + (n * NC, n * 0) + tail), (_consumer, cargs + (n * NC + 1, n * 0 + 1) + tail),
                            (_producer, prod)], [4, 1], [CREGS, 24])
    else:
        gl.warp_specialize([(_consumer, cargs + (n * NC, n * 0) + tail), (_consumer, cargs + (n * NC + 1, n * 0 + 1) + tail),
                            (_consumer, cargs + (n * NC + 2, n * 0 + 2) + tail), (_producer, prod)], [4, 4, 1],
                           [CREGS, CREGS, 24])
    for i in gl.static_range(NSTAGE):
        mbarrier.invalidate(full.index(i))
        mbarrier.invalidate(empty.index(i))


def ws_fwd(q, k, v, un, nc: int, stages: int, scale: float, cregs: int = 168, maxnreg: int | None = None):
    """un: the TileUnion of nc*4-token tiles. Returns (o, lse)."""
    from nsa.ops.triton.tile_gluon import _descriptors
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[3]
    o = torch.empty_like(q)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    kd, vd = _descriptors(k, v)
    nt = un.size.shape[2]
    kw = {"maxnreg": maxnreg} if maxnreg else {}
    _ws_fwd[(nt, B * H)](q, kd, vd, un.blocks, un.bits, un.size, o, lse, q.stride(0), q.stride(1), q.stride(2),
                         o.stride(0), o.stride(1), o.stride(2), T, H, nt, scale * 1.4426950408889634,
                         UW=un.blocks.shape[3], CREGS=cregs, num_warps=4,
                         **kw)
    return o, lse
