"""The query-tile selection forward (select_tile._tile_fwd_kernel's contract) in Gluon for Hopper.

Same program decomposition and the same arithmetic in the same order as the Triton kernel (its
output is bitwise the Triton kernel's, bench/RESULTS.md table 16), but written at the level Triton
leaves to its compiler: each union block's K and V tiles ([64 keys, d] each) arrive by TMA into a ring
of NSTAGE shared-memory slots guarded by mbarriers, so a whole 16 KB tile is one copy issued by one
thread instead of 8 cp.async per thread; q (m*G = 64 rows) stays in registers as wgmma's A operand, so
a program needs NSTAGE * 32 KB of shared memory and three programs share an SM at NSTAGE=2.

Eligible (gluon_tile_ok): CUDA compute capability 9.x, bf16 / fp16, d_k = d_v = 128, l_sel = 64,
m * G = 64 rows (the paper shape's m=4 at G=16), K / V viewable as 2-D [B*T, H*d] (heads adjacent, rows
evenly strided) with 16-byte aligned strides and bases. Everything else runs the Triton kernel.
Gluon has no interpreter: tests/test_triton_tile.py compiles it for sm_90 on the CPU and compares it
bitwise with the Triton kernel on a GPU.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..fallbacks import count_fallback
from .guard import Guard

ROWS = 64          # wgmma rows of one warpgroup: m * G must fill them exactly
_OFF: dict[str, str] = {}   # device -> why a Gluon kernel failed there: the Triton kernels from then on
HEAD_DIM = 128
LSEL = 64


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton has Gluon with its Hopper TMA / wgmma / mbarrier modules."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Gluon path
        return False
    return True


def _rows_2d(x: torch.Tensor) -> bool:
    """x [B, T, H, d] addressable as a 2-D [B*T, H*d] array with 16-byte aligned strides and base."""
    B, T, H, d = x.shape
    es = x.element_size()
    return (x.stride(3) == 1 and x.stride(2) == d and (B == 1 or x.stride(0) == T * x.stride(1))
            and (x.stride(1) * es) % 16 == 0 and x.data_ptr() % 16 == 0)


def gluon_tile_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: int, l_sel: int) -> bool:
    """Whether the Gluon tile kernels take this call (module doc); cheap, host-side only."""
    if not (q.is_cuda and str(q.device) not in _OFF and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype == v.dtype):
        return False
    G = q.shape[2] // k.shape[2]
    if (m * G != ROWS or l_sel != LSEL or q.shape[3] != HEAD_DIM or v.shape[3] != HEAD_DIM
            or q.stride(3) != 1 or not (_rows_2d(k) and _rows_2d(v))):
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9 and gluon_available()


@functools.lru_cache(maxsize=None)
def _kernel():
    """The @gluon.jit kernel, built on first use (importing Gluon costs nothing on CPU-only runs)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    # Gluon is experimental: the TMA load was async_copy_global_to_shared up to Triton 3.6, async_load later
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier      # renamed likewise

    @gluon.jit
    def _skip(FLAG, GUARD: gl.constexpr):
        """guard.py's contract: mode 1 runs iff the flag is set, mode 2 iff it is clear."""
        f = gl.load(FLAG)
        if GUARD == 1:
            skip = f == 0
        else:
            skip = f != 0
        return skip

    @gluon.jit
    def _load_block(k_desc, v_desc, bar, ks, vs, UB, idx, row0, h, LS: gl.constexpr, D: gl.constexpr,
                    DV: gl.constexpr):
        """Union entry idx's block: its K / V tiles [LS, d] of head h into one ring slot, counted on bar."""
        j = gl.load(UB + idx)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [row0 + j * LS, h * D], bar, ks)
        tma_load(v_desc, [row0 + j * LS, h * DV], bar, vs)

    @gluon.jit
    def _gtile_fwd(Q, k_desc, v_desc, UB, UBITS, USZ, O, LSE, FLAG, sqb, sqt, sqh, sob, sot, soh, T, H, NT,
                   scale_log2, G: gl.constexpr, M: gl.constexpr, LS: gl.constexpr, D: gl.constexpr,
                   DV: gl.constexpr, UW: gl.constexpr, NSTAGE: gl.constexpr, GUARD: gl.constexpr,
                   num_warps: gl.constexpr):
        R: gl.constexpr = G * M
        if GUARD != 0:
            if _skip(FLAG, GUARD):
                return
        n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        # S = q K^T [R, LS] and O [R, DV] accumulators: one warpgroup, 16-row wgmma atoms
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, LS, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        # rows token-major (row = ti * G + g), as _tile_rows; the tile's q once, into wgmma's A registers
        rq = gl.arange(0, R, layout=gl.SliceLayout(1, ld))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        tq = n * M + rq // G
        qv = gl.load(Q + b.to(gl.int64) * sqb + tq.to(gl.int64)[:, None] * sqt + (h * G + rq % G)[:, None] * sqh
                     + cq[None, :], mask=(tq < T)[:, None], other=0.0)
        qa = gl.convert_layout(qv, gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2))
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NSTAGE, LS, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NSTAGE, LS, DV], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(bars.index(i), count=1)
        ubase = (pid_bh.to(gl.int64) * NT + n) * UW
        nu = gl.load(USZ + pid_bh.to(gl.int64) * NT + n)
        row0 = b * T                    # block j's keys are rows row0 + j*LS .. of the 2-D K / V views
        for i in gl.static_range(NSTAGE - 1):
            if i < nu:
                _load_block(k_desc, v_desc, bars.index(i), k_smem.index(i), v_smem.index(i), UB, ubase + i, row0, h,
                            LS, D, DV)
        rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma_s))
        ti = rs // G
        tok = n * M + ti
        kk = gl.arange(0, LS, layout=gl.SliceLayout(0, mma_s))
        m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(1, mma_s))
        acc = gl.zeros([R, DV], gl.float32, layout=mma_o)
        s_zero = gl.zeros([R, LS], gl.float32, layout=mma_s)
        for it in range(nu):
            nxt = it + NSTAGE - 1
            if nxt < nu:   # refill the slot step it-1 read: the barrier puts every warp past its wgmma waits
                cta_barrier()
                s2 = nxt % NSTAGE
                _load_block(k_desc, v_desc, bars.index(s2), k_smem.index(s2), v_smem.index(s2), UB, ubase + nxt, row0,
                            h, LS, D, DV)
            slot = it % NSTAGE
            mbarrier.wait(bars.index(slot), phase=(it // NSTAGE) & 1)
            j = gl.load(UB + ubase + it)
            bits = gl.load(UBITS + ubase + it)
            sacc = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sacc = warpgroup_mma_wait(num_outstanding=0, deps=(sacc, ))
            # the row's token chose block j, and causality (keys past T are past every token)
            kp = j * LS + kk
            vis = (((bits >> ti) & 1) != 0)[:, None] & (kp[None, :] <= tok[:, None])
            sc = gl.where(vis, sacc * scale_log2, float("-inf"))
            # attn.online_softmax_step, operation for operation
            m_new = gl.maximum(m_i, gl.max(sc, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(sc - m_safe[:, None])
            alpha = gl.exp2(m_i - m_safe)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, mma_o))[:, None]
            pa = gl.convert_layout(p.to(k_desc.dtype), gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2))
            acc = warpgroup_mma(pa, v_smem.index(slot), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            m_i = m_new
        for i in gl.static_range(NSTAGE):
            mbarrier.invalidate(bars.index(i))
        has = l_i > 0.0
        lsafe = gl.where(has, l_i, 1.0)
        o = acc / gl.convert_layout(lsafe, gl.SliceLayout(1, mma_o))[:, None]
        lse = gl.where(has, (m_i + gl.log2(lsafe)) / 1.4426950408889634, float("-inf"))
        ro = gl.arange(0, R, layout=gl.SliceLayout(1, mma_o))
        co = gl.arange(0, DV, layout=gl.SliceLayout(0, mma_o))
        to = n * M + ro // G
        gl.store(O + b.to(gl.int64) * sob + to.to(gl.int64)[:, None] * sot + (h * G + ro % G)[:, None] * soh
                 + co[None, :], o.to(k_desc.dtype), mask=(to < T)[:, None])
        gl.store(LSE + (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G, lse, mask=tok < T)

    @gluon.jit
    def _gtile_dq(Q, k_desc, v_desc, DO, LSE, DELTA, GATE, UB, UBITS, USZ, DQ, DQ_IN, FLAG, sqb, sqt, sqh,
                  sdb, sdt, sdh, sgt, T, H, NT, scale_log2, scale, G: gl.constexpr, M: gl.constexpr,
                  LS: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, UW: gl.constexpr, NSTAGE: gl.constexpr,
                  HAS_GATE: gl.constexpr, ACC_DQ: gl.constexpr, GUARD: gl.constexpr, num_warps: gl.constexpr):
        """select_tile._tile_bwd_dq_kernel, operation for operation: q and dO in wgmma's A registers."""
        R: gl.constexpr = G * M
        if GUARD != 0:
            if _skip(FLAG, GUARD):
                return
        n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, LS, 16])
        mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rq = gl.arange(0, R, layout=gl.SliceLayout(1, ld))
        cq = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        cv = gl.arange(0, DV, layout=gl.SliceLayout(0, ld))
        tq = (n * M + rq // G).to(gl.int64)
        hq = h * G + rq % G
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_s, k_width=2)
        qa = gl.convert_layout(gl.load(Q + b.to(gl.int64) * sqb + tq[:, None] * sqt + hq[:, None] * sqh + cq[None, :],
                                       mask=(tq < T)[:, None], other=0.0), a_op)
        doa = gl.convert_layout(gl.load(DO + b.to(gl.int64) * sdb + tq[:, None] * sdt + hq[:, None] * sdh
                                        + cv[None, :], mask=(tq < T)[:, None], other=0.0), a_op)
        rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma_s))
        ti = rs // G
        tok = n * M + ti
        ridx = (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G
        row_ok = tok < T
        lse = gl.load(LSE + ridx, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = gl.load(DELTA + ridx, mask=row_ok, other=0.0)
        if HAS_GATE:
            gate = gl.load(GATE + ridx * sgt, mask=row_ok, other=0.0).to(gl.float32)
        else:
            gate = gl.full([R], 1.0, gl.float32, layout=gl.SliceLayout(1, mma_s))
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NSTAGE, LS, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NSTAGE, LS, DV], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(bars.index(i), count=1)
        ubase = (pid_bh.to(gl.int64) * NT + n) * UW
        nu = gl.load(USZ + pid_bh.to(gl.int64) * NT + n)
        row0 = b * T
        for i in gl.static_range(NSTAGE - 1):
            if i < nu:
                _load_block(k_desc, v_desc, bars.index(i), k_smem.index(i), v_smem.index(i), UB, ubase + i, row0, h,
                            LS, D, DV)
        kk = gl.arange(0, LS, layout=gl.SliceLayout(0, mma_s))
        s_zero = gl.zeros([R, LS], gl.float32, layout=mma_s)
        dq = gl.zeros([R, D], gl.float32, layout=mma_q)
        for it in range(nu):
            nxt = it + NSTAGE - 1
            if nxt < nu:
                cta_barrier()
                s2 = nxt % NSTAGE
                _load_block(k_desc, v_desc, bars.index(s2), k_smem.index(s2), v_smem.index(s2), UB, ubase + nxt, row0,
                            h, LS, D, DV)
            slot = it % NSTAGE
            mbarrier.wait(bars.index(slot), phase=(it // NSTAGE) & 1)
            j = gl.load(UB + ubase + it)
            bits = gl.load(UBITS + ubase + it)
            sacc = warpgroup_mma(qa, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dpa = warpgroup_mma(doa, v_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            sacc, dpa = warpgroup_mma_wait(num_outstanding=0, deps=(sacc, dpa))
            kp = j * LS + kk
            vis = ((((bits >> ti) & 1) != 0) & row_ok)[:, None] & (kp[None, :] <= tok[:, None])
            p = gl.where(vis, gl.exp2(sacc * scale_log2 - lse[:, None]), 0.0) * gate[:, None]
            ds = p * (dpa - delta[:, None])
            dsa = gl.convert_layout(ds.to(k_desc.dtype), gl.DotOperandLayout(operand_index=0, parent=mma_q, k_width=2))
            dq = warpgroup_mma(dsa, k_smem.index(slot), dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        for i in gl.static_range(NSTAGE):
            mbarrier.invalidate(bars.index(i))
        dq = dq * scale
        ro = gl.arange(0, R, layout=gl.SliceLayout(1, mma_q))
        co = gl.arange(0, D, layout=gl.SliceLayout(0, mma_q))
        to = n * M + ro // G
        off = ((b.to(gl.int64) * T + to) * (H * G) + h * G + ro % G)[:, None] * D + co[None, :]   # contiguous dq
        if ACC_DQ:
            dq += gl.load(DQ_IN + off, mask=(to < T)[:, None], other=0.0)
        gl.store(DQ + off, dq.to(DQ.dtype.element_ty), mask=(to < T)[:, None])

    return _gtile_fwd, _gtile_dq


def _launch(name: str, q: torch.Tensor, fn) -> bool:
    """Runs fn (a Gluon launch); on failure (Gluon is experimental: an API or compiler change in
    another Triton) the Triton kernels take this device from now on, counted and warned once: False."""
    try:
        fn()
        return True
    except Exception as exc:  # noqa: BLE001 - any failure: the caller launches the Triton kernel instead
        why = f"{name} failed: {type(exc).__name__}: {str(exc)[:160]}"
        _OFF[str(q.device)] = why
        count_fallback("tile_gluon->triton")
        warnings.warn(f"query-tile selection: {why}; using the Triton kernels from now on", RuntimeWarning,
                      stacklevel=3)
        return False


def gtile_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, un, o: torch.Tensor, lse: torch.Tensor, *,
              m: int, scale: float, stages: int, guard: Guard | None = None) -> bool:
    """Fills o [B,T,HQ,dv] / lse [B,T,HQ] fp32 as select_tile.slc_fwd_tile does, for inputs that
    gluon_tile_ok accepts; un: the TileUnion; stages: K/V ring slots (>= 2). False (nothing written)
    when the Gluon kernel failed to build or launch (_launch)."""
    return _launch("the Gluon tile forward", q, lambda: _fwd(q, k, v, un, o, lse, m, scale, stages, guard))


def _fwd(q, k, v, un, o, lse, m, scale, stages, guard) -> None:
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[3]
    kd, vd = _descriptors(k, v)
    flag, mode = guard if guard is not None else (lse, 0)
    nt = un.size.shape[2]
    _kernel()[0][(nt, B * H)](q, kd, vd, un.blocks, un.bits, un.size, o, lse, flag, q.stride(0), q.stride(1),
                              q.stride(2), o.stride(0), o.stride(1), o.stride(2), T, H, nt, scale * 1.4426950408889634,
                              G=HQ // H, M=m, LS=LSEL, D=D, DV=DV, UW=un.blocks.shape[3], NSTAGE=stages, GUARD=mode,
                              num_warps=4)


def _descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors of K / V as 2-D [B*T, H*d] arrays, [LSEL, d] boxes (one block of one head)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, T, H, D = k.shape
    lay = gl.NVMMASharedLayout.get_default_for([LSEL, D], gl.bfloat16 if k.dtype == torch.bfloat16 else gl.float16)
    return (TensorDescriptor(k, [B * T, H * D], [k.stride(1), 1], [LSEL, D], lay),
            TensorDescriptor(v, [B * T, H * v.shape[3]], [v.stride(1), 1], [LSEL, v.shape[3]], lay))


def gtile_dq(q, k, v, do, lse, delta, gate_arg, un, dq, dq_in, sgt: int, *, m: int, scale: float, stages: int,
             has_gate: bool, guard: Guard | None = None) -> bool:
    """select_tile.tile_dq's kernel for inputs gluon_tile_ok accepts (do with a unit last stride): writes
    dq (contiguous [B,T,HQ,dk]) = the tile's selection dq * scale (+ dq_in when given); lse / delta
    contiguous fp32, gate_arg / sgt as select._bwd_args'. False as gtile_fwd's."""
    return _launch("the Gluon tile dq", q, lambda: _dq(q, k, v, do, lse, delta, gate_arg, un, dq, dq_in, sgt, m,
                                                         scale, stages, has_gate, guard))


def _dq(q, k, v, do, lse, delta, gate_arg, un, dq, dq_in, sgt, m, scale, stages, has_gate, guard) -> None:
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[3]
    kd, vd = _descriptors(k, v)
    flag, mode = guard if guard is not None else (lse, 0)
    nt = un.size.shape[2]
    _kernel()[1][(nt, B * H)](q, kd, vd, do, lse, delta, gate_arg, un.blocks, un.bits, un.size, dq,
                              dq if dq_in is None else dq_in, flag, q.stride(0), q.stride(1), q.stride(2),
                              do.stride(0), do.stride(1), do.stride(2), sgt, T, H, nt, scale * 1.4426950408889634,
                              scale, G=HQ // H, M=m, LS=LSEL, D=D, DV=DV, UW=un.blocks.shape[3], NSTAGE=stages,
                              HAS_GATE=has_gate, ACC_DQ=dq_in is not None, GUARD=mode, num_warps=4)
