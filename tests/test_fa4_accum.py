"""FlashAttention-4's backward without its pre- and postprocess around q's rows (nsa/ops/fa4_accum.py).

On the CPU the flash branches run on the "reference" backend, whose stand-in accumulator (to_accum) is laid out
by the torch form of the layout (accum_offsets); q's gradient kernels read it through the Triton form
(acc_rows / acc_cols) in the interpreter. On a GPU with FA4 the layout is checked against FA4's own
postprocess, and the branch backward against FA4's untouched one."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from nsa.ops import branch_sums, fa4_accum  # noqa: E402
from nsa.ops.fa4_accum import acc_cols, acc_rows, accum_offsets, rows_pre  # noqa: E402
from nsa.ops.testing import make_inputs, rel_rms  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.tuning import FlashBranchTuning, TileTuning, tuning_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _offsets_kernel(OUT, S_R, D: tl.constexpr, A: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, D)
    off = acc_rows(r, D, A)[:, None] + acc_cols(c, D, A)[None, :]
    tl.store(OUT + r[:, None] * D + c[None, :], off, mask=(r < S_R)[:, None])


@pytest.mark.parametrize("d,a", [(64, 2), (128, 1), (32, 1)])
def test_accum_layout_is_one_permutation_in_torch_and_triton(d, a):
    """Each tile's offsets are a permutation of the tile's own range; the kernels' helpers give the same."""
    s_r = 3 * 64 * a
    off = accum_offsets(s_r, d, a)
    assert torch.equal(off.view(-1).sort().values, torch.arange(s_r * d))
    assert torch.equal(off.view(3, -1).min(1).values, torch.arange(3) * 64 * a * d)   # tile by tile
    got = torch.empty(s_r, d, dtype=torch.int32, device=DEV)
    _offsets_kernel[(s_r // 32,)](got, s_r, D=d, A=a, BR=32)
    assert torch.equal(got.cpu().long(), off)


def test_rows_pre_writes_what_fa4s_preprocess_writes_for_zero_o():
    """dpsum = -dlse and lse * log2(e) (0 where lse = -inf) on real rows; 0 and +inf on the padding rows."""
    B, NH, S, s_r = 2, 3, 70, 128
    g = torch.Generator().manual_seed(0)
    lse = torch.randn(B, NH, S, generator=g)
    lse[0, 1, 5] = float("-inf")
    dlse = torch.randn(B, NH, S, generator=g)
    dpsum = torch.full((B, NH, s_r), float("nan"), device=DEV)
    lse2 = torch.full((B, NH, s_r), float("nan"), device=DEV)
    rows_pre(lse.to(DEV), dlse.to(DEV), dpsum, lse2)
    dpsum, lse2 = dpsum.cpu(), lse2.cpu()
    assert torch.equal(dpsum[..., :S], -dlse) and (dpsum[..., S:] == 0).all()
    want = lse * fa4_accum.LOG2E
    want[0, 1, 5] = 0.0
    assert torch.equal(lse2[..., :S], want) and torch.isinf(lse2[..., S:]).all() and (lse2[..., S:] > 0).all()


def test_q_gradient_from_the_split_windows_accumulator_equals_the_converted_one(monkeypatch):
    """FlashBranchTuning.fa4_accum with the window split into G batches (B = 1; the accumulator's batch g, head h
    is query head h*G + g) and the selection on query tiles (its deferred dq reads both accumulators): output
    and all gradients equal the op where the branches return dq (to 1e-6), and both accumulators were made.
    tests/test_qsum.py runs every other path that reads q's terms (B = 2, the window unsplit) on the
    accumulators against the fp64 oracle."""
    made = []
    real = branch_sums.to_accum
    monkeypatch.setattr(branch_sums, "to_accum", lambda *a: made.append(a[0].shape) or real(*a))
    x = make_inputs(1, 45, 4, 2, 16, 16, l=8, d=4, seed=5)
    do = torch.randn(1, 45, 4, 16, generator=torch.Generator().manual_seed(1))
    res = []
    for accum in (True, False):
        flash_t = FlashBranchTuning(win="reference", cmp="reference", fa4_accum=accum, win_split_min_t=0)
        tuning = tuning_for("cpu").replace(flash=flash_t, tile=TileTuning(m=2))
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25, tuning=tuning)
        res.append((o, torch.autograd.grad(o, args, do)))
    assert len(made) == 2 and (2, 45, 2, 16) in made, made   # the split window's [G, T, H, d], the compressed one's
    assert rel_rms(res[0][0], res[1][0]) == 0
    for name, a, b in zip("q k_cmp v_cmp k_slc v_slc k_win v_win gates".split(), res[0][1], res[1][1]):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-6, name


def test_a_layout_the_kernels_do_not_read_fails(monkeypatch):
    """The stand-in written in another layout (rows and columns of each tile swapped) gives a wrong q gradient:
    the kernels read the accumulator through the layout, not around it."""
    real = fa4_accum.accum_offsets
    monkeypatch.setattr(fa4_accum, "accum_offsets",
                        lambda s_r, d, a: real(s_r, d, a).view(-1, 64 * a, d).flip(1).reshape(s_r, d))
    x = make_inputs(1, 45, 4, 2, 16, 16, l=8, d=4, seed=5)
    grads = []
    for accum in (True, False):
        tuning = tuning_for("cpu").replace(flash=FlashBranchTuning(win="reference", cmp="reference", fa4_accum=accum))
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25, tuning=tuning)
        grads.append(torch.autograd.grad(o.square().sum(), args[0])[0])
    assert rel_rms(grads[0], grads[1]) > 0.05


def _fake_fa4(monkeypatch, caches: bool = True, fail: bool = False):
    """A stand-in for FA4's interface module with its backward entry's call sequence: the preprocess, a "main
    kernel" adding 1 to the dq accumulator, the postprocess, each reached through the module's names as FA4's are
    (calls: what ran, and what the preprocess left in dpsum / lse_log2)."""
    import sys
    import types
    fi, calls = types.ModuleType("flash_attn.cute.interface"), []

    def fa4_pre(out, dout, dpsum, lse, lse_log2, dq_accum, *a, **kw):
        calls.append("fa4_pre")
        dpsum.fill_(7.0), lse_log2.fill_(7.0), dq_accum.zero_()

    def fa4_post(accum, output, scale, *a, **kw):
        calls.append("fa4_post")
        output.fill_(float(accum[0, 0, 0]) * scale)

    def entry(q, k, v, out, dout, lse, softmax_scale=None, causal=False, window_size_left=None,
              window_size_right=None, dlse=None):
        B, S, H, d = q.shape
        s_r = -(-S // 64) * 64
        acc = torch.full((B, H, s_r * d), float("nan"), device=q.device)
        dpsum, lse2 = (torch.full((B, H, s_r), float("nan"), device=q.device) for _ in range(2))
        fi._bwd_preprocess(out, dout, dpsum, lse, lse2, acc, None, None, dlse, "bf16", d, d, 64, fake_mode=False,
                           hdim_multiple_of=32)
        calls.append(("pre", dpsum, lse2))
        if fail:
            raise RuntimeError("main kernel failed")
        acc += 1.0
        dq = torch.empty_like(q)
        fi._bwd_postprocess_convert(acc, dq, softmax_scale, None, None, 90, "bf16", d, 64, 256, 1, False,
                                    fake_mode=False, hdim_multiple_of=32)
        return dq, k.clone(), v.clone()

    if caches:
        fa4_pre.compile_cache, fa4_post.compile_cache = {}, {}
    fi._bwd_preprocess, fi._bwd_postprocess_convert, fi._flash_attn_bwd = fa4_pre, fa4_post, entry
    fi._tile_size_bwd_sm90 = lambda *a: types.SimpleNamespace(num_wg=2, dQ_swapAB=False, dQ_single_wg=False,
                                                               m_block_size=64, AtomLayoutMdQ=1)
    pkg, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    pkg.cute, cute.interface = cute, fi
    for name, mod in (("flash_attn", pkg), ("flash_attn.cute", cute), ("flash_attn.cute.interface", fi)):
        monkeypatch.setitem(sys.modules, name, mod)
    fa4_accum.accum_a.cache_clear()
    return fi, calls


@pytest.mark.parametrize("case", ["keep", "convert", "no rows", "unknown FA4", "failing"])
def test_fa4_bwd_swaps_exactly_the_passes_it_replaces(monkeypatch, case):
    """fa4_bwd against a stand-in FA4 (CPU): with D given, its rows kernel replaces the preprocess (dpsum = D,
    lse * log2(e), FA4's padding; the accumulator zeroed before the main kernel adds to it); with keep_dq the
    accumulator comes back as an Accum and the postprocess never runs, else it converts dq; without D, FA4's own
    preprocess runs; on an FA4 whose functions lack the compile caches this was written against, both do; the module's
    functions are FA4's again afterwards, also when its entry raises."""
    fi, calls = _fake_fa4(monkeypatch, caches=case != "unknown FA4", fail=case == "failing")
    own = (fi._bwd_preprocess, fi._bwd_postprocess_convert)
    B, S, H, d = 1, 70, 2, 32
    g = torch.Generator().manual_seed(3)
    q, o, do = (torch.randn(B, S, H, d, generator=g).to(DEV) for _ in range(3))
    k, v = torch.randn(B, S, 1, d).to(DEV), torch.randn(B, S, 1, d).to(DEV)
    lse, d_rows = torch.randn(B, H, S, generator=g).to(DEV), torch.randn(B, H, S, generator=g).to(DEV)
    kw = dict(scale=0.5, window=None, keep_dq=case != "convert")
    try:
        if case == "failing":
            with pytest.raises(RuntimeError, match="main kernel failed"):
                fa4_accum.fa4_bwd(q, k, v, o, do, lse, d_rows, **kw)
            assert (fi._bwd_preprocess, fi._bwd_postprocess_convert) == own
            return
        dq, dk, dv = fa4_accum.fa4_bwd(q, k, v, o, do, lse, None if case == "no rows" else d_rows, **kw)
    finally:
        fa4_accum.accum_a.cache_clear()
    assert (fi._bwd_preprocess, fi._bwd_postprocess_convert) == own
    ran = [c for c in calls if isinstance(c, str)]
    _, dpsum, lse2 = next(c for c in calls if isinstance(c, tuple))
    if case in ("keep", "convert"):
        assert "fa4_pre" not in ran
        assert torch.equal(dpsum[..., :S], d_rows) and (dpsum[..., S:] == 0).all()
        assert torch.equal(lse2[..., :S], lse * fa4_accum.LOG2E) and torch.isinf(lse2[..., S:]).all()
    else:
        assert "fa4_pre" in ran
    if case in ("keep", "no rows"):
        assert isinstance(dq, fa4_accum.Accum) and "fa4_post" not in ran
        assert (dq.s_r, dq.a, dq.scale) == (128, 1, 0.5) and (dq.buf == 1.0).all()   # zeroed, then the kernel's 1
    else:
        assert torch.is_tensor(dq) and ran[-1] == "fa4_post" and (dq == 0.5).all()


def _fa4():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    return pytest.importorskip("flash_attn.cute.interface")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_accum_layout_is_fa4s(d):
    """FA4's own postprocess converts an accumulator holding each element's offset (in three base-64 digits,
    exact in bf16) to dq: every element lands where acc_rows + acc_cols says, for every batch and head,
    with a padded last tile."""
    fi = _fa4()
    from flash_attn.cute.cute_dsl_utils import torch2cute_dtype_map
    a = fa4_accum.accum_a(d)
    assert a is not None
    cfg = fi._tile_size_bwd_sm90(d, d, True, False)
    B, H, S = 2, 3, 200
    s_r = -(-S // (64 * a)) * 64 * a
    code = torch.arange(s_r * d, device="cuda").repeat(B, H, 1)
    got = torch.zeros(B, S, H, d, dtype=torch.int64, device="cuda")
    for digit in range(3):
        out = torch.empty(B, S, H, d, device="cuda", dtype=torch.bfloat16)
        fi._bwd_postprocess_convert(((code // 64 ** digit) % 64).float(), out, 1.0, None, None, 90,
                                    torch2cute_dtype_map[torch.bfloat16], d, cfg.m_block_size, cfg.num_wg * 128,
                                    cfg.AtomLayoutMdQ, cfg.dQ_swapAB, fake_mode=False, hdim_multiple_of=32)
        got += out.long() * 64 ** digit
    want = accum_offsets(s_r, d, a)[:S].cuda()
    for b in range(B):
        for h in range(H):
            assert torch.equal(got[b, :, h], want), f"b={b} h={h}"


def _dq_of(acc: fa4_accum.Accum, B: int, S: int, NH: int, d: int) -> torch.Tensor:
    """The fp32 dq [B, S, NH, d] an Accum holds."""
    off = accum_offsets(acc.s_r, d, acc.a)[:S].to(acc.buf.device)
    return (acc.buf.view(B, NH, -1)[:, :, off] * acc.scale).transpose(1, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 512])
@pytest.mark.parametrize("HQ,H,d", [(64, 4, 128), (12, 2, 64)])
def test_gpu_fa4_bwd_without_its_passes_matches_fa4s(window, HQ, H, d):
    """fa4_bwd with D given and dq kept: the accumulator's dq, dk and dv against FA4's untouched backward
    (which forms D itself from o): relative RMS <= 0.5% (D's summation order and dq's bf16 rounding differ)."""
    fi = _fa4()
    g = torch.Generator(device="cuda").manual_seed(d)
    B, T, scale = 2, 3000, d ** -0.5
    q = torch.randn(B, T, HQ, d, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(B, T, H, d, generator=g, device="cuda").bfloat16() for _ in range(2))
    do = torch.randn(B, T, HQ, d, generator=g, device="cuda").bfloat16()
    wl = (window - 1, 0) if window else (None, None)
    o, lse = branch_sums.flash_fwd("fa4", q, k, v, scale=scale, window=window)
    want = fi._flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=scale, causal=True, window_size_left=wl[0],
                              window_size_right=wl[1])[:3]
    d_rows = (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()
    acc, dk, dv = fa4_accum.fa4_bwd(q, k, v, o, do, lse, d_rows, scale=scale, window=window, keep_dq=True)
    assert isinstance(acc, fa4_accum.Accum)
    dq = _dq_of(acc, B, T, HQ, d)
    for name, a, b in (("dq", dq, want[0]), ("dk", dk, want[1]), ("dv", dv, want[2])):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 5e-3, f"{name}: {rel_rms(a, b):.2e}"
