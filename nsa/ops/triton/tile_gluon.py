"""The query-tile selection kernels in Gluon (Triton's explicit-layout dialect) for Hopper: forward and dq
(select_tile._tile_fwd_kernel / _tile_bwd_dq_kernel), each with the Triton kernel's contract, and the helpers
the Gluon dK/dV walk shares (walk_gluon.py: eligibility, K / V descriptors, the launch fallback).

Same programs and the same arithmetic in the same order as the Triton kernels (their outputs are bitwise
the Triton kernels', tests/test_triton_tile_gluon.py), written at the level Triton leaves to its compiler: the
K / V tiles of a block ([64 keys, d] each) and a walk step's q / dO rows (one [G, d] box per token) arrive
by TMA, one copy issued by one thread instead of 8 cp.async per thread, into rings of mbarrier-guarded
shared-memory slots filled a step ahead (the block ids and bits that steer them read a step before that,
so neither a refill nor a step's mask waits on a global load); the tile kernels keep q (and dO) in registers as wgmma's A
operand, so the forward needs 64 KB of shared memory and three programs share an SM (Triton's: two). The
forward can also write the op's output from its epilogue (function.Combine, TileTuning.gluon_combine).

Eligible (nsa/ops/plan.py, _tile_gluon_ok / _walk): CUDA compute capability 9.x, bf16 / fp16, d_k = d_v = 128,
l_sel = 64, 64 rows of whole tokens' heads for the walk, 64 or 128 for the tile kernels (the paper shape's
m=4 or m=8 at G=16: one warpgroup, or two in step), K / V addressable as 2-D
[B*T, H*d] (heads adjacent, rows evenly strided) and, for the walk, q / dO as [B*T*HQ, d], all 16-byte
aligned. Everything else, and every call on a device where a Gluon kernel once failed to build or launch
(_launch: Gluon is experimental), runs the Triton kernels. Gluon has no interpreter:
tests/test_triton_tile_gluon.py compiles the kernels for sm_90 on the CPU and compares them bitwise with
the Triton kernels on a GPU.
"""
from __future__ import annotations

import functools
import warnings

import torch

from .. import fallbacks
from ..fallbacks import count_fallback
from .qsum import add_q_terms, q_add_args   # add_q_terms: a @triton.jit helper, called from Gluon too

# m * G of the tile kernels: one warpgroup (4 warps) per 64 rows. 128 rows (8 warps, m=8 at G=16) load each block
# of the union of twice the tokens once, but both warpgroups compute all of it in step (docs/kernels.md: m)
TILE_ROWS = (64, 128)
HEAD_DIM = 128     # d_k = d_v of the shapes these kernels were written and measured for
LSEL = 64          # keys per selection block (one TMA box of K or V)
# the forward: three 4-warp programs per SM need <= 168 registers (Triton 3.6 allocates 164 for the one that also
# writes the op's output, 3.9 171 uncapped; 3.9 174 for the plain one with the union prefetch)
FWD_MAX_REGS = 168


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Whether this Triton has Gluon with its Hopper TMA / wgmma / mbarrier modules."""
    try:
        from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means no Gluon path
        return False
    return True


def _target_arch() -> int:
    """The compute capability Triton compiles for (e.g. 90): the current device's, or bench_regs.py's
    stand-in target when it compiles for a GPU that is not there; 0 when there is none."""
    try:
        from triton.runtime import driver
        return int(driver.active.get_current_target().arch)
    except Exception:  # noqa: BLE001 - no GPU driver: no Gluon path
        return 0


@functools.lru_cache(maxsize=None)
def _kernel():
    """The @gluon.jit tile kernels (forward, dq), built on first use (CPU-only runs never import Gluon)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    # Gluon is experimental: the TMA load was async_copy_global_to_shared up to Triton 3.6, async_load later
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier      # renamed likewise

    @gluon.jit
    def _issue_block(k_desc, v_desc, bar, ks, vs, j, row0, h, LS, D, DV):
        """Block j's K / V tiles [LS, d] of head h into one ring slot, counted on bar (the sizes: the callers'
        constexprs; unannotated, as gl is no free name of this body)."""
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [row0 + j * LS, h * D], bar, ks)
        tma_load(v_desc, [row0 + j * LS, h * DV], bar, vs)

    @gluon.jit
    def _load_block(k_desc, v_desc, bar, ks, vs, UB, idx, row0, h, LS: gl.constexpr, D: gl.constexpr,
                    DV: gl.constexpr):
        """Union entry idx's block: its K / V tiles [LS, d] of head h into one ring slot, counted on bar."""
        _issue_block(k_desc, v_desc, bar, ks, vs, gl.load(UB + idx), row0, h, LS, D, DV)

    @gluon.jit
    def _tile_program(USZ, T, H, NT, UW: gl.constexpr):
        """This tile program's (n, b, h): tile n of (batch b, KV head h); its union entries' base ubase and
        count nu; row0 = b * T, where block j's keys start at row row0 + j * LSEL of the 2-D K / V views."""
        n = gl.program_id(0)
        pid_bh = gl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        ubase = (pid_bh.to(gl.int64) * NT + n) * UW
        nu = gl.load(USZ + pid_bh.to(gl.int64) * NT + n)
        return n, b, h, ubase, nu, b * T

    @gluon.jit
    def _toks(PB, n, rr, T, G: gl.constexpr, M: gl.constexpr, HAS_PERM: gl.constexpr):
        """Token (int64; T past the end) of each row rr of tile n: position n*M + rr // G, or with HAS_PERM
        the token there (PB: this (b, h)'s [T] of TileUnion.perm, select_tile._tile_rows)."""
        tok = (n * M + rr // G).to(gl.int64)
        if HAS_PERM:
            tok = gl.load(PB + tok, mask=tok < T, other=T).to(gl.int64)
        return tok

    @gluon.jit
    def _rows_a(X, PB, b, h, n, T, sxb, sxt, sxh, G: gl.constexpr, M: gl.constexpr, D: gl.constexpr,
                parent: gl.constexpr, NW: gl.constexpr, HAS_PERM: gl.constexpr):
        """The tile's [G*M, D] rows of X (token-major, row = ti * G + g, as select_tile._tile_rows; zeros past
        T) as wgmma's A operand in registers, for an accumulator of layout `parent`."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])
        r = gl.arange(0, G * M, layout=gl.SliceLayout(1, ld))
        c = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        t = _toks(PB, n, r, T, G, M, HAS_PERM)
        x = gl.load(X + b.to(gl.int64) * sxb + t[:, None] * sxt + (h * G + r % G)[:, None] * sxh + c[None, :],
                    mask=(t < T)[:, None], other=0.0)
        return gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=parent, k_width=2))

    @gluon.jit
    def _kv_ring(k_desc, v_desc, UB, ubase, nu, row0, h, NSTAGE: gl.constexpr, LS: gl.constexpr, D: gl.constexpr,
                 DV: gl.constexpr):
        """The tile kernels' ring: NSTAGE slots of a block's K / V tiles with their mbarriers, the tile's first
        NSTAGE - 1 union blocks (entries ubase ..., nu of them) already issued."""
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NSTAGE, LS, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NSTAGE, LS, DV], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NSTAGE, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NSTAGE):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(NSTAGE - 1):
            if i < nu:
                _load_block(k_desc, v_desc, bars.index(i), k_smem.index(i), v_smem.index(i), UB, ubase + i, row0, h,
                            LS, D, DV)
        return k_smem, v_smem, bars

    @gluon.jit
    def _kv_ahead(UB, UBITS, ubase, nu, NSTAGE: gl.constexpr):
        """_kv_step's carried union entries before step 0: the block of entry NSTAGE - 1 (the first refill) and
        entry 0's block and bits (0 past the union)."""
        return (gl.load(UB + ubase + NSTAGE - 1, mask=NSTAGE - 1 < nu, other=0), gl.load(UB + ubase, mask=nu > 0,
                other=0), gl.load(UBITS + ubase, mask=nu > 0, other=0))

    @gluon.jit
    def _kv_step(k_desc, v_desc, k_smem, v_smem, bars, UB, UBITS, ubase, it, nu, row0, h, ahead, NSTAGE, LS, D, DV):
        """Step it of a tile kernel's union walk: union entry it + NSTAGE - 1 into the slot step it - 1 read
        (the CTA barrier first puts every warp past that step's wgmma waits), then wait for entry it's slot.
        Returns (slot, block j, bits of the tile's tokens that chose j, ahead). The union entries come a
        step before their use (ahead = _kv_ahead's three, carried): neither the refill's TMA issue nor the step's
        mask then waits on a global load. (The sizes are the caller's constexprs.)"""
        jt, jc, bc = ahead
        nxt = it + NSTAGE - 1
        if nxt < nu:
            cta_barrier()
            s2 = nxt % NSTAGE
            _issue_block(k_desc, v_desc, bars.index(s2), k_smem.index(s2), v_smem.index(s2), jt, row0, h, LS, D, DV)
        j = jc
        bits = bc
        jt = gl.load(UB + ubase + nxt + 1, mask=nxt + 1 < nu, other=0)
        jc = gl.load(UB + ubase + it + 1, mask=it + 1 < nu, other=0)
        bc = gl.load(UBITS + ubase + it + 1, mask=it + 1 < nu, other=0)
        slot = it % NSTAGE
        mbarrier.wait(bars.index(slot), phase=(it // NSTAGE) & 1)
        return slot, j, bits, (jt, jc, bc)

    @gluon.jit
    def _combine_rows(ob, GT, OC, OW, O2, SLOT, PB, b, h, n, T, H, n_per_b, s_rows, G: gl.constexpr, M: gl.constexpr,
                      DV: gl.constexpr, CROWS: gl.constexpr, lay: gl.constexpr, HAS_PERM: gl.constexpr):
        """o = g_cmp * o_cmp + g_slc * ob + g_win * o_win into O2 for the tile's rows, ob [G*M, DV] (layout lay)
        being its selection output: function._combine_fwd_kernel, operation for operation (gates GT [B,T,HQ,3],
        o_win / O2 [B,T,HQ,DV] contiguous; o_cmp OC likewise, or with CROWS in the dense compressed problem's
        rows through SLOT, function._cmp_rows)."""
        r = gl.arange(0, G * M, layout=gl.SliceLayout(1, lay))
        c = gl.arange(0, DV, layout=gl.SliceLayout(0, lay))
        t = _toks(PB, n, r, T, G, M, HAS_PERM)
        ok = t < T
        rf = (b.to(gl.int64) * T + t) * (H * G) + h * G + r % G      # flat (b, t, hq) row
        g0 = gl.load(GT + rf * 3, mask=ok, other=0.0).to(gl.float32)
        g1 = gl.load(GT + rf * 3 + 1, mask=ok, other=0.0).to(gl.float32)
        g2 = gl.load(GT + rf * 3 + 2, mask=ok, other=0.0).to(gl.float32)
        if CROWS:
            slot = gl.load(SLOT + (rf - b.to(gl.int64) * n_per_b), mask=ok, other=-1)
            oc_row = (b.to(gl.int64) * s_rows + slot) * DV
            oc_ok = ok & (slot >= 0)
        else:
            oc_row = rf * DV
            oc_ok = ok
        off = rf[:, None] * DV + c[None, :]
        res = g0[:, None] * gl.load(OC + oc_row[:, None] + c[None, :], mask=oc_ok[:, None], other=0.0).to(gl.float32)
        res += g1[:, None] * ob.to(gl.float32)
        res += g2[:, None] * gl.load(OW + off, mask=ok[:, None], other=0.0).to(gl.float32)
        gl.store(O2 + off, res.to(O2.dtype.element_ty), mask=ok[:, None])

    @gluon.jit
    def _gtile_fwd(Q, k_desc, v_desc, UB, UBITS, USZ, PERM, O, LSE, GT, OC, OW, O2, SLOT, sqb, sqt, sqh, sob, sot,
                   soh, T, H, NT, n_per_b, s_rows, scale_log2, G: gl.constexpr, M: gl.constexpr, LS: gl.constexpr,
                   D: gl.constexpr, DV: gl.constexpr, UW: gl.constexpr, NSTAGE: gl.constexpr,
                   COMBINE: gl.constexpr, CROWS: gl.constexpr, HAS_PERM: gl.constexpr,
                   num_warps: gl.constexpr):
        R: gl.constexpr = G * M
        n, b, h, ubase, nu, row0 = _tile_program(USZ, T, H, NT, UW)
        # S = q K^T [R, LS] and O [R, DV] accumulators: a warpgroup per 64 rows, 16-row wgmma atoms
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, LS, 16])
        mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, DV, 16])
        pb = PERM + (b.to(gl.int64) * H + h) * T
        qa = _rows_a(Q, pb, b, h, n, T, sqb, sqt, sqh, G, M, D, mma_s, num_warps, HAS_PERM)   # q once, in registers
        k_smem, v_smem, bars = _kv_ring(k_desc, v_desc, UB, ubase, nu, row0, h, NSTAGE, LS, D, DV)
        rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma_s))
        ti = rs // G
        tok = _toks(pb, n, rs, T, G, M, HAS_PERM)
        kk = gl.arange(0, LS, layout=gl.SliceLayout(0, mma_s))
        m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma_s))
        l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(1, mma_s))
        acc = gl.zeros([R, DV], gl.float32, layout=mma_o)
        s_zero = gl.zeros([R, LS], gl.float32, layout=mma_s)
        ahead = _kv_ahead(UB, UBITS, ubase, nu, NSTAGE)
        for it in range(nu):
            slot, j, bits, ahead = _kv_step(k_desc, v_desc, k_smem, v_smem, bars, UB, UBITS, ubase, it, nu, row0, h,
                                            ahead, NSTAGE, LS, D, DV)
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
        gl.store(LSE + (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G, lse, mask=tok < T)
        ro = gl.arange(0, R, layout=gl.SliceLayout(1, mma_o))
        co = gl.arange(0, DV, layout=gl.SliceLayout(0, mma_o))
        to = _toks(pb, n, ro, T, G, M, HAS_PERM)
        ob = o.to(k_desc.dtype)
        gl.store(O + b.to(gl.int64) * sob + to.to(gl.int64)[:, None] * sot + (h * G + ro % G)[:, None] * soh
                 + co[None, :], ob, mask=(to < T)[:, None])
        if COMBINE:   # the op's output: o's rows through K/V slot 0 (free now: every copy into it was waited
            # for, every wgmma that read it too) into 16-byte rows, the operands' loads coalesced
            ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            if R <= LS:
                stage = v_smem.index(0)
                cta_barrier()
                stage.store(ob)
                cta_barrier()
                ob_ld = stage.load(ld)
            else:   # 128 rows do not fit a [LS, DV] slot: the compiler's own staging (one CTA per SM has room)
                ob_ld = gl.convert_layout(ob, ld)
            _combine_rows(ob_ld, GT, OC, OW, O2, SLOT, pb, b, h, n, T, H, n_per_b, s_rows, G, M, DV, CROWS, ld,
                          HAS_PERM)

    @gluon.jit
    def _gtile_dq(Q, k_desc, v_desc, DO, LSE, DELTA, GATE, UB, UBITS, USZ, PERM, DQ, DQ_IN, GC, SLOT, GW, sgc,
                  gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s,
                  sqb, sqt, sqh, sdb, sdt, sdh, sgt, T, H, NT, scale_log2, scale, G: gl.constexpr, M: gl.constexpr,
                  LS: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, UW: gl.constexpr, NSTAGE: gl.constexpr,
                  HAS_GATE: gl.constexpr, ACC_DQ: gl.constexpr, HAS_GC: gl.constexpr,
                  HAS_GW: gl.constexpr, GC_ACC: gl.constexpr, GW_ACC: gl.constexpr, HAS_PERM: gl.constexpr,
                  num_warps: gl.constexpr):
        """select_tile._tile_bwd_dq_kernel, operation for operation: q and dO in wgmma's A registers."""
        R: gl.constexpr = G * M
        n, b, h, ubase, nu, row0 = _tile_program(USZ, T, H, NT, UW)
        mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, LS, 16])
        mma_q: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])
        pb = PERM + (b.to(gl.int64) * H + h) * T
        qa = _rows_a(Q, pb, b, h, n, T, sqb, sqt, sqh, G, M, D, mma_s, num_warps, HAS_PERM)
        doa = _rows_a(DO, pb, b, h, n, T, sdb, sdt, sdh, G, M, DV, mma_s, num_warps, HAS_PERM)
        rs = gl.arange(0, R, layout=gl.SliceLayout(1, mma_s))
        ti = rs // G
        tok = _toks(pb, n, rs, T, G, M, HAS_PERM)
        ridx = (b.to(gl.int64) * T + tok) * (H * G) + h * G + rs % G
        row_ok = tok < T
        lse = gl.load(LSE + ridx, mask=row_ok, other=0.0) * 1.4426950408889634
        delta = gl.load(DELTA + ridx, mask=row_ok, other=0.0)
        if HAS_GATE:
            gate = gl.load(GATE + ridx * sgt, mask=row_ok, other=0.0).to(gl.float32)
        else:
            gate = gl.full([R], 1.0, gl.float32, layout=gl.SliceLayout(1, mma_s))
        k_smem, v_smem, bars = _kv_ring(k_desc, v_desc, UB, ubase, nu, row0, h, NSTAGE, LS, D, DV)
        kk = gl.arange(0, LS, layout=gl.SliceLayout(0, mma_s))
        s_zero = gl.zeros([R, LS], gl.float32, layout=mma_s)
        dq = gl.zeros([R, D], gl.float32, layout=mma_q)
        ahead = _kv_ahead(UB, UBITS, ubase, nu, NSTAGE)
        for it in range(nu):
            slot, j, bits, ahead = _kv_step(k_desc, v_desc, k_smem, v_smem, bars, UB, UBITS, ubase, it, nu, row0, h,
                                            ahead, NSTAGE, LS, D, DV)
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
        to = _toks(pb, n, ro, T, G, M, HAS_PERM)
        rb = to * (H * G) + h * G + ro % G   # the row within its batch
        off = (b.to(gl.int64) * T * (H * G) + rb)[:, None] * D + co[None, :]   # contiguous dq
        if ACC_DQ:
            dq += gl.load(DQ_IN + off, mask=(to < T)[:, None], other=0.0)
        # the flash branches' gradients of q: the Triton helper, on Gluon's layouts
        dq = add_q_terms(dq, GC, SLOT, GW, sgc, gc_n, gc_h, gc_s, gw_t, gw_h, gw_g, gw_s, b.to(gl.int64), rb, to < T,
                         off, co, D, HAS_GC, HAS_GW, GC_ACC, GW_ACC)
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
        fallbacks.refuse("gluon_tile", (str(q.device),), why)   # the planner plans it away from now on
        count_fallback("tile_gluon->triton")
        warnings.warn(f"query-tile selection: {why}; using the Triton kernels from now on", RuntimeWarning,
                      stacklevel=3)
        return False


def gtile_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, un, o: torch.Tensor, lse: torch.Tensor, *,
              m: int, scale: float, stages: int, combine=None) -> bool:
    """Fills o [B,T,HQ,dv] / lse [B,T,HQ] fp32 as select_tile.slc_fwd_tile does, for inputs that
    the plan gives the Gluon tile kernels; un: the TileUnion; stages: K/V ring slots (>= 2). combine: a
    function.Combine whose out also gets the gated sum of the three branches. False (nothing written) when the Gluon kernel failed to
    build or launch (_launch)."""
    return _launch("the Gluon tile forward", q, lambda: _fwd(q, k, v, un, o, lse, m, scale, stages, combine))


def _fwd(q, k, v, un, o, lse, m, scale, stages, combine) -> None:
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[3]
    kd, vd = _descriptors(k, v)
    nt = un.size.shape[2]
    if combine is not None:
        cb = (combine.gates, combine.o_cmp, combine.o_win, combine.out, combine.slot, combine.n_per_b,
              combine.s_rows)
    else:
        cb = (o, o, o, o, o, 1, 1)
    _kernel()[0][(nt, B * H)](q, kd, vd, un.blocks, un.bits, un.size, un.perm_arg(), o, lse, *cb[:5], q.stride(0),
                              q.stride(1), q.stride(2), o.stride(0), o.stride(1), o.stride(2), T, H, nt, *cb[5:],
                              scale * 1.4426950408889634, G=HQ // H, M=m, LS=LSEL, D=D, DV=DV, UW=un.blocks.shape[3],
                              NSTAGE=stages, COMBINE=combine is not None, HAS_PERM=un.perm is not None,
                              CROWS=combine is not None and combine.rows, num_warps=m * (HQ // H) // 16,
                              maxnreg=FWD_MAX_REGS)


def _descriptors(k: torch.Tensor, v: torch.Tensor):
    """TMA descriptors of K / V as 2-D [B*T, H*d] arrays, [LSEL, d] boxes (one block of one head)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    B, T, H, D = k.shape
    lay = gl.NVMMASharedLayout.get_default_for([LSEL, D], gl.bfloat16 if k.dtype == torch.bfloat16 else gl.float16)
    return (TensorDescriptor(k, [B * T, H * D], [k.stride(1), 1], [LSEL, D], lay),
            TensorDescriptor(v, [B * T, H * v.shape[3]], [v.stride(1), 1], [LSEL, v.shape[3]], lay))


def gtile_dq(q, k, v, do, lse, delta, gate_arg, un, dq, dq_in, sgt: int, *, m: int, scale: float, stages: int,
             has_gate: bool, add=None) -> bool:
    """select_tile.tile_dq's kernel for inputs the plan gives the Gluon tile kernels (do with a unit last stride): writes
    dq (contiguous [B,T,HQ,dk]) = the tile's selection dq * scale (+ dq_in when given, + add's terms: a
    qsum.QAdd); lse / delta contiguous fp32, gate_arg / sgt as select._bwd_args'. False as gtile_fwd's."""
    return _launch("the Gluon tile dq", q, lambda: _dq(q, k, v, do, lse, delta, gate_arg, un, dq, dq_in, sgt, m,
                                                         scale, stages, has_gate, add))


def _dq(q, k, v, do, lse, delta, gate_arg, un, dq, dq_in, sgt, m, scale, stages, has_gate, add) -> None:
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[3]
    kd, vd = _descriptors(k, v)
    nt = un.size.shape[2]
    add_args, add_kw = q_add_args(add, dq)
    _kernel()[1][(nt, B * H)](q, kd, vd, do, lse, delta, gate_arg, un.blocks, un.bits, un.size, un.perm_arg(), dq,
                              dq if dq_in is None else dq_in, *add_args, q.stride(0), q.stride(1), q.stride(2),
                              do.stride(0), do.stride(1), do.stride(2), sgt, T, H, nt, scale * 1.4426950408889634,
                              scale, G=HQ // H, M=m, LS=LSEL, D=D, DV=DV, UW=un.blocks.shape[3], NSTAGE=stages,
                              HAS_GATE=has_gate, ACC_DQ=dq_in is not None, HAS_PERM=un.perm is not None,
                              **add_kw, num_warps=m * (HQ // H) // 16)
