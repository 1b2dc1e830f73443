"""The decode step's split-K compressed pass (decode._cmp_kernel's contract) in Gluon for Hopper.

The Triton kernel keeps a row's G query heads on the MMA's M side (16 rows), so every sub-tile's softmax,
block-score map and P V go through cross-warp reductions and layout conversions, about a dozen CTA barriers
per 64 compressed tokens: it streams the step's compressed K / V at ~2.9-3.0 TB/s where a bare read of the same
bytes reaches ~3.8 (bench/RESULTS.md tables 14 and 30). Here the tokens are on M instead (swap-AB), per program:

- a producer warp copies each sub-tile's compressed K and V ([BN, d] boxes, the r-1 halo token first, as the
  Triton kernel loads them) by TMA into a ring of NS mbarrier-guarded slots;
- NC consumer warpgroups take the sub-tiles in turn (consumer w: the program's sub-tiles w, w+NC, ...), each
  with its own softmax state, written as its own split-K partial (partial c*NC + w of the row's NCH*NC), so
  none waits for another: S^T = K q^T [BN, GP] (q^T from shared memory), the sub-tile max per head over its
  rows, p, the block-score map sp^T = cnt^T p (p split into three bf16 parts: fp32-exact, as the Triton
  kernel's _dot_split3), O^T += V^T p_own [d, GP]; all on wgmma, with p in shared memory as its B operand.

The arithmetic is the Triton kernel's (same sub-tiles, halo, maxima, overlap counts, split): partials agree to
fp32 rounding, not bitwise (other MMA shapes). Eligible (gluon_cmp_ok): compute capability 9.x with Gluon,
bf16 / fp16, G <= 16, d_k = d_v in (64, 128), a 64-token sub-tile, K~ / V~ addressable as 2-D [B*N, H*d]
(tile_gluon._rows_2d). Everything else, and every call on a device where this kernel once failed to build or
launch, runs the Triton kernel (counted, warned once). GPU tests compare it with the Triton kernel.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..fallbacks import count_fallback
from .decode_launch import _pdl_launch_dependents   # a @triton.jit helper: Gluon kernels call it too
from .tile_gluon import _rows_2d, _target_arch, gluon_available

BN = 64          # compressed tokens per sub-tile (own + halo): the M of every wgmma here
GP = 16          # query heads per KV head, padded: the wgmmas' N
NC = 2           # consumer warpgroups per program
NS = 5           # ring slots of K / V sub-tiles (32 KB each at d = 128): one program per SM
PROGRAMS_PER_SM = 1   # the ring and p buffers take ~197 KB of shared memory: the split-K plan's programs per SM
_OFF: dict[str, str] = {}   # device -> why the Gluon pass failed there: the Triton kernel from then on
_BUILT: set = set()         # (device, dtype, sizes, POS_PTR) compiled here (both PDL variants)


def gluon_cmp_ok(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, bn: int) -> bool:
    """Whether this decode call's compressed pass can run here (cheap, host-side only); bn: the plan's sub-tile."""
    if not (q.is_cuda and str(q.device) not in _OFF and q.dtype in (torch.bfloat16, torch.float16)
            and k_cmp.dtype == q.dtype == v_cmp.dtype and k_cmp.shape[1] > 0):
        return False
    dk, dv, G = q.shape[3], v_cmp.shape[3], q.shape[2] // k_cmp.shape[2]
    return (bn == BN and G <= GP and dk == dv and dk in (64, 128) and k_cmp.shape[3] == dk and q.stride(3) == 1
            and _rows_2d(k_cmp) and _rows_2d(v_cmp) and _target_arch() // 10 == 9 and gluon_available())


def cmp_spec(q, k_cmp, v_cmp, pos_t, sp, ms, cm, cl, co, *, spos: int, pos_base: int, Tq: int, nch: int,
             nsub: int, nbcap: int, subs: int, scale_log2: float, l: int, d: int, l_sel: int, nbj: int,
             pos_ptr: bool) -> tuple | None:
    """The launch (name, kernel, grid, args, constexprs; decode_launch's spec, PDL still to add) that fills
    decode._cmp_kernel's outputs for a call gluon_cmp_ok accepts, with NC partials per chunk (cm / cl / co
    [R, nch * NC, HQ(, dv)]). None when the kernel fails to build here (compiled ahead of its first launch,
    with and without PDL): the Triton kernel takes this device from then on."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, N, H, D = k_cmp.shape
    G = q.shape[2] // H
    grid = (H, nch, cm.shape[0])
    try:
        lay = gl.NVMMASharedLayout.get_default_for([BN, D], gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16)
        kd = TensorDescriptor(k_cmp, [B * N, H * D], [k_cmp.stride(1), 1], [BN, D], lay)
        vd = TensorDescriptor(v_cmp, [B * N, H * D], [v_cmp.stride(1), 1], [BN, D], lay)
        kernel = _kernel(G, D, l // d, l_sel // d, nbj, l)
        args = (q, kd, vd, pos_t, sp, ms, cm, cl, co, q.stride(0), q.stride(1), q.stride(2), spos, pos_base, Tq, H, N,
                nch, nsub, nbcap, subs, scale_log2)
        kw = dict(STRIDE=d, POS_PTR=pos_ptr, num_warps=4)
        key = (str(q.device), q.dtype, G, D, l, d, l_sel, nbj, pos_ptr)
        if key not in _BUILT:
            for pdl in (False, True):
                kernel.warmup(*args, grid=grid, **kw, PDL=pdl)
            _BUILT.add(key)
    except Exception as exc:  # noqa: BLE001 - Gluon is experimental: any failure means the Triton kernel
        why = f"the Gluon compressed decode pass failed to build: {type(exc).__name__}: {str(exc)[:160]}"
        _OFF[str(q.device)] = why
        count_fallback("decode_gluon->triton")
        warnings.warn(f"decode: {why}; using the Triton kernel from now on", RuntimeWarning, stacklevel=3)
        return None
    return "cmp", kernel, grid, args, kw


@functools.lru_cache(maxsize=None)
def _kernel(g: int, d: int, lc: int, r: int, nbj: int, l_cmp: int):
    """The @gluon.jit pass for G = g heads, d_k = d_v = d, lc = l/d stride chunks per compressed token, r = l_sel/d
    per selection block, nbj blocks per sub-tile, built on first use (CPU-only runs never import Gluon). The
    sizes are this factory's constants: warp_specialize hands its partitions tensors and scalars only."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared   # renamed after 3.6
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    M = gl.constexpr(BN)
    N = gl.constexpr(GP)
    NCONS = gl.constexpr(NC)
    NSLOT = gl.constexpr(NS)
    G = gl.constexpr(g)
    D = gl.constexpr(d)
    LC = gl.constexpr(lc)
    R = gl.constexpr(r)
    NBJ = gl.constexpr(nbj)
    CCS = gl.constexpr(nbj * r)         # own compressed tokens per sub-tile
    L_CMP = gl.constexpr(l_cmp)

    @gluon.jit
    def _producer(kd, vd, k_smem, v_smem, full, empty, row0, h, st_lo, n_sub):
        """Sub-tile st_lo + i (its halo token first) into slot i % NSLOT once its last reader released it."""
        for i in range(n_sub):
            s = i % NSLOT
            mbarrier.wait(empty.index(s), phase=((i // NSLOT) & 1) ^ 1)
            mbarrier.expect(full.index(s), kd.block_type.nbytes + vd.block_type.nbytes)
            r = row0 + (st_lo + i) * CCS - (LC - 1)      # negative or past this row's tokens: masked by consumers
            tma_load(kd, [r, h * D], full.index(s), k_smem.index(s))
            tma_load(vd, [r, h * D], full.index(s), v_smem.index(s))

    @gluon.jit
    def _consumer(SP, MS, CM, CL, CO, k_smem, v_smem, q_smem, c_smem, p_smem, po_smem, full, empty, w, row, h, c,
                  st_lo, n_sub, n_vis, NCH, NSUB, NBCAP, H, scale_log2):
        """Sub-tiles st_lo + w, + w + NCONS, ... of this program: decode._cmp_kernel's loop body with tokens on M;
        its softmax partial goes to partial c * NCONS + w."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
        dt: gl.constexpr = k_smem.dtype
        HQ = H * G
        tok = gl.arange(0, M, layout=gl.SliceLayout(1, mma))            # row of the sub-tile (halo first)
        g = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
        g_ok = g < G
        hq = (h * G + g).to(gl.int64)
        jr = gl.arange(0, M, layout=gl.SliceLayout(1, mma))             # block rows of the map (NBJ used)
        rel = tok - (LC - 1)
        own_rel = (rel >= 0) & (rel < CCS)
        s_zero = gl.zeros([M, N], gl.float32, layout=mma)
        acc = gl.zeros([D, N], gl.float32, layout=mma)                  # O^T: [d_v, heads]
        m_run = gl.full([N], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
        l_run = gl.zeros([N], gl.float32, layout=gl.SliceLayout(0, mma))
        rh = row * H + h
        sp_row = (row * HQ + hq) * NBCAP                                # [N] int64
        for i in range(w, n_sub, NCONS):
            slot = i % NSLOT
            st = st_lo + i
            ki = st * CCS + rel
            k_ok = (ki >= 0) & (ki < n_vis)
            own = k_ok & own_rel
            mbarrier.wait(full.index(slot), phase=(i // NSLOT) & 1)
            sacc = warpgroup_mma(k_smem.index(slot), q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sacc = warpgroup_mma_wait(num_outstanding=0, deps=(sacc, ))
            x = gl.where(k_ok[:, None], sacc * scale_log2, float("-inf"))
            m_s = gl.max(x, axis=0)                                     # finite: the sub-tile sees a token
            p = gl.exp2(x - m_s[None, :])
            m_new = gl.maximum(m_run, m_s)
            alpha = gl.exp2(m_run - m_new)
            p_own = gl.where(own[:, None], p * gl.exp2(m_s - m_new)[None, :], 0.0)
            l_run = l_run * alpha + gl.sum(p_own, axis=0)
            # p = p1 + p2 + p3 in bf16 (each residual exact in fp32): the map is fp32-exact
            p1 = p.to(gl.bfloat16)
            r1 = p - p1.to(gl.float32)
            p2 = r1.to(gl.bfloat16)
            p_smem.index(0).store((r1 - p2.to(gl.float32)).to(gl.bfloat16))
            p_smem.index(1).store(p2)
            p_smem.index(2).store(p1)
            po_smem.store(p_own.to(dt))
            fence_async_shared()
            cta_barrier()
            y = warpgroup_mma(c_smem, p_smem.index(0), s_zero, use_acc=False, is_async=True)
            y = warpgroup_mma(c_smem, p_smem.index(1), y, is_async=True)
            y = warpgroup_mma(c_smem, p_smem.index(2), y, is_async=True)
            acc = acc * alpha[None, :]
            acc = warpgroup_mma(v_smem.index(slot).permute((1, 0)), po_smem, acc, is_async=True)
            y, acc = warpgroup_mma_wait(num_outstanding=0, deps=(y, acc))
            mbarrier.arrive(empty.index(slot), count=1)
            gl.store(SP + sp_row[None, :] + (st * NBJ + jr)[:, None], y, mask=(jr < NBJ)[:, None] & g_ok[None, :])
            gl.store(MS + (rh.to(gl.int64) * NSUB + st) * N + g, m_s)
            m_run = m_new
        part = (row * (NCH * NCONS) + c * NCONS + w).to(gl.int64) * HQ + hq
        gl.store(CM + part, m_run, mask=g_ok)
        gl.store(CL + part, l_run, mask=g_ok)
        dvr = gl.arange(0, D, layout=gl.SliceLayout(1, mma))
        gl.store(CO + part[None, :] * D + dvr[:, None], acc, mask=g_ok[None, :])

    @gluon.jit
    def _cmp_gluon(Q, kd, vd, POS, SP, MS, CM, CL, CO, sqb, sqt, sqh, spos, pos_base, Tq, H, NBUF, NCH, NSUB, NBCAP,
                   SUBS, scale_log2, STRIDE: gl.constexpr, POS_PTR: gl.constexpr, PDL: gl.constexpr,
                   num_warps: gl.constexpr):
        h = gl.program_id(0)
        c = gl.program_id(1)
        row = gl.program_id(2)
        _pdl_launch_dependents(PDL)
        b = (row // Tq).to(gl.int64)
        iq = row % Tq
        if POS_PTR:
            t = gl.load(POS + b * spos).to(gl.int64) + iq
        else:
            t = pos_base.to(gl.int64) + iq
        n_vis = gl.minimum(gl.where(t + 1 >= L_CMP, (t + 1 - L_CMP) // STRIDE + 1, 0), NBUF)
        st_end = gl.where(n_vis > 0, (n_vis + LC - 1 + CCS - 1) // CCS, 0)
        st_lo = c * SUBS
        n_sub = gl.maximum(gl.minimum(st_lo + SUBS, st_end) - st_lo, 0).to(gl.int32)
        # q [GP, d] (rows past G zero) and the overlap counts cnt^T [block j, sub-tile row] into shared memory
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        gq = gl.arange(0, N, layout=gl.SliceLayout(1, ld))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        qv = gl.load(Q + b * sqb + iq * sqt + (h * G + gq).to(gl.int64)[:, None] * sqh + cq[None, :],
                     mask=(gq < G)[:, None], other=0.0)
        q_smem = gl.allocate_shared_memory(kd.dtype, [N, D], gl.NVMMASharedLayout.get_default_for([N, D], kd.dtype),
                                           qv)
        cl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        jj = gl.arange(0, M, layout=gl.SliceLayout(1, cl))[:, None]
        rr = gl.arange(0, M, layout=gl.SliceLayout(0, cl))[None, :] - (LC - 1)   # the row's token, own-relative
        ov = gl.minimum(rr + LC - 1, jj * R + R - 1) - gl.maximum(rr, jj * R) + 1
        cnt = gl.where((ov > 0) & (jj < NBJ), ov, 0).to(gl.bfloat16)
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [M, M], gl.NVMMASharedLayout.get_default_for([M, M],
                                                                                                     gl.bfloat16), cnt)
        # per consumer: p's three bf16 parts (the map's B operands) and p_own (P V's), [BN, GP] each
        p_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, N], gl.bfloat16)
        po_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, N], kd.dtype)
        p0 = gl.allocate_shared_memory(gl.bfloat16, [4, M, N], p_sl)
        p1 = gl.allocate_shared_memory(gl.bfloat16, [4, M, N], p_sl)
        po0 = gl.allocate_shared_memory(kd.dtype, [M, N], po_sl)
        po1 = gl.allocate_shared_memory(kd.dtype, [M, N], po_sl)
        k_smem = gl.allocate_shared_memory(kd.dtype, [NSLOT, M, D], kd.layout)
        v_smem = gl.allocate_shared_memory(vd.dtype, [NSLOT, M, D], vd.layout)
        full = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSLOT):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        cta_barrier()
        ca = (SP, MS, CM, CL, CO, k_smem, v_smem, q_smem, c_smem)
        cb = (full, empty)
        cc = (row, h, c, st_lo, n_sub, n_vis, NCH, NSUB, NBCAP, H, scale_log2)
        gl.warp_specialize([(_consumer, ca + (p0, po0) + cb + (c * 0, ) + cc),
                            (_consumer, ca + (p1, po1) + cb + (c * 0 + 1, ) + cc),
                            (_producer, (kd, vd, k_smem, v_smem, full, empty, (b * NBUF).to(gl.int32), h, st_lo,
                                         n_sub))], [4, 1], [160, 24])
        for i in gl.static_range(NSLOT):
            mbarrier.invalidate(full.index(i))
            mbarrier.invalidate(empty.index(i))

    return _cmp_gluon
