"""Triton NSA kernels against nsa.ops.reference: forward, block_idx and every gradient.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 must be
set before triton is imported, hence the top of this module); with CUDA they run natively. Shapes are
tiny and awkward (T not a multiple of any block, T < l, G = 1/2/3/16, d_k != d_v, l_sel not a power
of two, n_sel below the number of forced blocks) because the interpreter runs each program in Python.
Every output buffer the kernels allocate is NaN-poisoned, so an unwritten element fails.
bf16 is covered by tests/test_triton_gpu.py (the interpreter's bf16 tl.dot is unreliable).
"""
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nsa.ops import common  # noqa: E402
from nsa.ops.reference import (nsa_reference, reference_block_scores,  # noqa: E402
                               reference_select_one)
from nsa.ops.triton import nsa_attention_triton, triton_available  # noqa: E402
from nsa.ops.triton import scores_unfused as tsu  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.testing import INPUT_NAMES, make_inputs as _make_inputs, rel_rms as rel_err  # noqa: E402
from nsa.ops.tuning import CmpDenseTuning, FlashBranchTuning, tuning_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = INPUT_NAMES


pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs fail (conftest)


def make_inputs(B, T, HQ, H, dk, dv, l, d, dtype, seed, gate_mode="rand"):
    """nsa.ops.testing.make_inputs as a dict of leaves; gate_mode names a branch to isolate with
    one-hot gates."""
    x = dict(zip(INPUT_NAMES, _make_inputs(B, T, HQ, H, dk, dv, l=l, d=d, dtype=dtype, device=DEV, seed=seed)))
    if gate_mode != "rand":  # one-hot gates isolate a branch
        gates = torch.zeros_like(x["gates"])
        gates[..., ("cmp", "slc", "win").index(gate_mode)] = 1.0
        x["gates"] = gates
    return {k: v.requires_grad_() for k, v in x.items()}


def with_cmp_dense(mode: str):
    """The device's preset with the compressed branch forced to `mode` (tuning.CmpDenseTuning)."""
    return tuning_for(DEV).replace(cmp_dense=CmpDenseTuning(mode))


def tol(dtype) -> float:
    if dtype == torch.float16:
        return 5e-3
    return 5e-3 if DEV == "cuda" else 1e-5   # fp32 dots are tf32 on the GPU


# B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, dtype, gate_mode, chunk
CASES = {
    "g2_dk16_dv32": (1, 77, 4, 2, 16, 32, 8, 4, 16, 3, 24, torch.float32, "rand", 1024),
    "g1_dk32_dv16_chunked": (1, 50, 2, 2, 32, 16, 16, 8, 16, 4, 16, torch.float32, "rand", 4),
    "g16_nsel1": (1, 40, 16, 1, 16, 16, 8, 8, 8, 1, 8, torch.float32, "rand", 1024),
    "g3_lsel24_slc_only": (1, 61, 6, 2, 16, 16, 12, 4, 24, 3, 20, torch.float32, "slc", 7),
    "t_below_l": (2, 6, 4, 2, 16, 16, 8, 4, 8, 2, 4, torch.float32, "rand", 1024),
    "fp16_g2": (1, 45, 4, 2, 32, 32, 8, 4, 16, 3, 16, torch.float16, "rand", 1024),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_reference(case):
    check_case(case)


def check_case(case, tuning=None):
    B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, dtype, gate_mode, chunk = CASES[case]
    x = make_inputs(B, T, HQ, H, dk, dv, l, d, dtype, seed=hash(case) % 1000, gate_mode=gate_mode)
    args = [x[n] for n in NAMES]
    kw = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    o, bi = nsa_triton_apply(*args, **kw, scale=dk ** -0.5, dkdv_chunk=chunk, tuning=tuning)
    # the reference in fp64 on the same (rounded) inputs
    ref_args = [a.detach().double().cpu().requires_grad_() for a in args]
    ro, rbi = nsa_reference(*ref_args, **kw)
    assert bi.dtype == torch.int64 and bi.shape == (B, T, H, n_sel)
    assert torch.equal(bi.cpu(), rbi), "selected blocks differ from the reference"
    assert torch.isfinite(o).all()
    assert rel_err(o, ro) <= tol(dtype)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    grads = torch.autograd.grad(o, args, do, allow_unused=False)
    rgrads = torch.autograd.grad(ro, ref_args, do.double().cpu(), allow_unused=True)
    for name, gk, gr, a in zip(NAMES, grads, rgrads, ref_args):
        gr = torch.zeros_like(a) if gr is None else gr   # e.g. k_cmp is empty when T < l
        assert gk.shape == gr.shape and gk.dtype == x[name].dtype, name
        assert torch.isfinite(gk).all(), f"non-finite d{name}"
        if gr.numel() and gr.norm() > 0:
            assert rel_err(gk, gr) <= tol(dtype) * 2, f"d{name}: {rel_err(gk, gr):.2e}"
        else:
            assert gk.abs().max().item() == 0 if gk.numel() else True


@pytest.mark.parametrize("case", ["g3_lsel24_slc_only", "g1_dk32_dv16_chunked"])
def test_selection_sub_block_tiles(case):
    """Key tiles smaller than a selected block (SelectTuning.fwd_keys / dq_keys): several tiles per
    block, the last one partly past l_sel (l_sel=24 in 16-row tiles), in the forward and the dq kernel."""
    base = tuning_for(DEV)
    check_case(case, base.replace(select=dataclasses.replace(base.select, fwd_keys=16, dq_keys=16)))


@pytest.mark.parametrize("case", ["g2_dk16_dv32", "g1_dk32_dv16_chunked", "g16_nsel1", "fp16_g2"])
def test_dense_cmp_branch_matches_reference(case):
    """The compressed branch as one causal SDPA over residue-regrouped queries (cmp_dense.py; the
    "math" stand-in on the CPU, cuDNN/flash in tests/test_triton_gpu.py), inside the full op."""
    check_case(case, with_cmp_dense("math"))


def test_gather_rows_kernel_and_inverse_maps():
    """The row gather of cmp_dense (-1 = zero row) and its maps: row_slot inverts slot_src exactly."""
    from nsa.ops.triton import cmp_dense
    x = torch.randn(2, 37, 24, device=DEV)
    idx = torch.tensor([5, -1, 0, 36, 5, -1, 12], device=DEV)
    y = cmp_dense.gather_rows(x, idx)
    want = torch.where((idx >= 0).view(1, -1, 1), x[:, idx.clamp(min=0)], 0.0)
    assert torch.equal(y, want)
    T, N, HQ, H, l, d = 70, common.num_cmp_tokens(70, 8, 4), 6, 2, 8, 4
    bhnd = cmp_dense._maps(T, N, HQ, H, l, d, DEV, False)
    for bnhd in (False, True):
        maps = cmp_dense._maps(T, N, HQ, H, l, d, DEV, bnhd)
        slot_src, row_slot, lse_slot, pad_rows = maps.slot_src, maps.row_slot, maps.lse_slot, maps.pad_rows
        assert torch.equal(pad_rows, (slot_src < 0).nonzero().view(-1))
        ok = row_slot >= 0
        assert torch.equal(slot_src[row_slot[ok]], torch.arange(T * HQ, device=DEV)[ok])
        assert int(ok.sum()) == (T - (l - 1)) * HQ == int((slot_src >= 0).sum())
        assert torch.equal(lse_slot, bhnd[1])   # the lse index is (head, position) in both layouts
        # bnhd row j*HQ' + h' holds what bhnd row h'*N + j holds
        hd = torch.arange(d * HQ * N, device=DEV)
        moved = (hd % N) * (d * HQ) + hd // N if bnhd else hd
        assert torch.equal(slot_src[moved], bhnd[0])


def test_dense_cmp_layouts_agree():
    """The compressed branch on the dense problem in either row layout (bhnd for torch's SDPA ops,
    bnhd for flash-attn's): the same o, lse and gradients."""
    from nsa.ops.triton import cmp_dense
    x = make_inputs(1, 70, 4, 2, 16, 16, 8, 4, torch.float32, seed=5)
    out = []
    for bnhd in (False, True):
        a = [x[n].detach().clone().requires_grad_() for n in ("q", "k_cmp", "v_cmp")]
        o, lse = cmp_dense.cmp_attention_dense(*a, l=8, d=4, scale=0.25, backend="math", bnhd=bnhd)
        out.append((o, lse, *torch.autograd.grad((o * o).sum(), a)))
    for u, v in zip(*out):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    assert out[0][1].isinf().any() and not out[0][1].isinf().all()


@pytest.mark.parametrize("parts", ["rows+win", "rows", "win", "rows+win, win unused"])
def test_q_fork_sums_every_branch_gradient(parts):
    """_QFork: q's gradient = the dense compressed rows' gradient gathered back + the window branch's +
    the Function's, in one fp32 sum; a branch whose output goes unused (a fallback) adds nothing."""
    from nsa.ops.triton import cmp_dense
    from nsa.ops.triton.qsum import fork_q as _fork
    B, T, HQ, dk, l, d = 2, 45, 4, 16, 8, 4
    N = common.num_cmp_tokens(T, l, d)
    q = torch.randn(B, T, HQ, dk, device=DEV, requires_grad=True)
    maps = cmp_dense._maps(T, N, HQ, 2, l, d, DEV, True) if "rows" in parts else None
    rows, q_win, q_slc = _fork(q, maps, "win" in parts)
    w = [torch.randn(B, T, HQ, dk, device=DEV) for _ in range(2)]
    loss = (q_slc * w[0]).sum()
    if "win" in parts and "unused" not in parts:
        assert q_win is not q
        loss = loss + (q_win.sin() * w[1]).sum()
    want = w[0] + (q.detach().cos() * w[1] if ("win" in parts and "unused" not in parts) else 0)
    if rows is not None:
        wr = torch.randn(rows.shape, device=DEV)
        loss = loss + (rows * wr).sum()
        back = maps.row_slot
        want = want + torch.where((back >= 0).view(1, -1, 1), wr[:, back.clamp(min=0)], 0.0).view(B, T, HQ, dk)
        assert torch.equal(rows, cmp_dense.gather_rows(q.detach().reshape(B, T * HQ, dk), maps.slot_src))
    loss.backward()
    torch.testing.assert_close(q.grad, want, rtol=1e-6, atol=1e-6)


def test_dense_cmp_probe_is_isolated_from_checkpointing(monkeypatch):
    """The one-off probe runs its own autograd inside the first (checkpointed) layer call; its saved
    tensors must not count as the layer's, or the recomputation would not match (seen at 8k on GPU)."""
    from torch.utils.checkpoint import checkpoint

    from nsa.ops.triton import cmp_dense

    def fake_probe(device, dtype, dk, dv, backends):   # what the real probe does: a small autograd run
        y = torch.randn(5, requires_grad=True)
        torch.autograd.grad((y * y.sin()).sum(), [y])
        return "math", "fake"

    monkeypatch.setattr(cmp_dense, "_probe", fake_probe)
    calls = []

    def layer(x):
        if not calls:   # first call only, as with the cached probe
            cmp_dense._probe_once("cuda:0", torch.bfloat16, 8, 8, ("math",))
        calls.append(1)
        return (x * x).sin()

    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():   # also under no_grad, as in an inference forward
        assert cmp_dense._probe_once("cuda:0", torch.bfloat16, 8, 8, ("math",))[0] == "math"
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert len(calls) == 2 and torch.allclose(x.grad, 2 * x * (x * x).cos())


def _refuse(*a, **k):
    raise RuntimeError("simulated refusal")


def _refused_then_plain(refused, plain):
    """The op under a tuning whose dense kernel refuses (a warning expected), then under the plain one:
    ((o, block_idx) of each, the inputs); the fallback counters and the refused paths start empty."""
    from nsa.ops import dispatch, fallbacks
    dispatch.reset_fallback_counts()
    fallbacks.reset_refusals()
    x = make_inputs(1, 45, 4, 2, 16, 16, 8, 4, torch.float32, seed=3)
    args = [x[n].detach() for n in NAMES]
    kw = dict(l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25)
    with pytest.warns(RuntimeWarning, match="simulated refusal"):
        first = nsa_triton_apply(*args, **kw, tuning=refused)
    return first, nsa_triton_apply(*args, **kw, tuning=plain), args


def test_dense_cmp_failure_falls_back_to_triton(monkeypatch):
    """A dense-kernel refusal at run time: same result from the Triton kernel, counted and warned."""
    from nsa.ops import dispatch
    from nsa.ops.triton import cmp_dense

    monkeypatch.setattr(cmp_dense, "cmp_attention_rows", _refuse)
    from nsa.ops import fallbacks

    monkeypatch.setattr(cmp_dense, "_PROBES", {})
    try:
        (o, bi), (o2, bi2), args = _refused_then_plain(with_cmp_dense("math"), with_cmp_dense("off"))
        assert torch.equal(o, o2) and torch.equal(bi, bi2)
        assert dispatch.fallback_counts() == {"cmp_dense:math->triton": 1}
    finally:
        fallbacks.reset_refusals()


def with_flash(**modes):
    """The device's preset with NSA branches on flash-attn modes (tuning.FlashBranchTuning)."""
    return tuning_for(DEV).replace(flash=FlashBranchTuning(**modes))


@pytest.mark.parametrize("case", ["g16_nsel1", "t_below_l", "fp16_g2"])
@pytest.mark.parametrize("modes", [dict(win="reference"), dict(win="reference", cmp="reference"),
                                   dict(win="reference", win_split_min_t=0)],
                         ids=["win", "win+cmp", "win_split"])
def test_flash_branches_match_reference(case, modes):
    """The window branch (and the compressed one) computed outside the Function on a dense kernel
    ("reference" stands in for flash-attn on the CPU; FA4 in tests/test_triton_gpu.py), also with the
    window's backward on grouped views (nsa/ops/window_split.py; B = 1 cases): the op's output, blocks
    and every gradient still match the fp64 reference."""
    check_case(case, with_flash(**modes))


def test_allow_flash_false_keeps_branches_on_triton(monkeypatch):
    """nsa_attention(allow_flash=False) (nsa.allow_flash_attn=false) ignores tuning.flash; with it the
    window branch calls the dense kernel once per op call."""
    from nsa.ops import KernelPolicy, nsa_attention
    from nsa.ops.dispatch import BRANCHES
    from nsa.ops.triton import function as tfn
    calls = []
    real = tfn.dense_attention
    monkeypatch.setattr(tfn, "dense_attention", lambda *a, **k: calls.append(k["backend"]) or real(*a, **k))
    x = make_inputs(1, 45, 4, 2, 16, 16, 8, 4, torch.float32, seed=4)
    pol = KernelPolicy("triton", DEV, "float32", {b: "triton" for b in BRANCHES}, {b: "test" for b in BRANCHES},
                       None, with_flash(win="reference"))
    kw = dict(l=8, d=4, l_sel=8, n_sel=2, w=8, backend=pol)
    o_off, _ = nsa_attention(*[x[n].detach() for n in NAMES], **kw, allow_flash=False)
    assert calls == []
    o_on, _ = nsa_attention(*[x[n].detach() for n in NAMES], **kw)
    assert calls == ["reference"]
    assert rel_err(o_on, o_off) <= tol(torch.float32)


def test_flash_window_failure_falls_back_to_triton(monkeypatch):
    """A flash-attn refusal of the window branch at run time: the Triton window kernel gives the
    result, counted and warned, and is used from then on."""
    from nsa.ops import dispatch
    from nsa.ops.triton import function as tfn

    from nsa.ops import fallbacks
    from nsa.ops.plan import plan_call

    monkeypatch.setattr(tfn, "dense_attention", _refuse)
    try:
        (o, bi), (o2, bi2), args = _refused_then_plain(with_flash(win="reference"), with_flash())
        assert torch.equal(o, o2) and torch.equal(bi, bi2)
        assert dispatch.fallback_counts() == {"win_flash:reference->triton": 1}
        plan = plan_call(*args[:5], l=8, d=4, l_sel=8, n_sel=2, w=8, tuning=with_flash(win="reference"))
        assert plan.win == "triton" and "refused" in plan.reason("win")
    finally:
        fallbacks.reset_refusals()


def test_block_idx_long_sequence():
    """T = 200: many eligible blocks, so the top-n ranking (not only forced blocks) decides."""
    B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w = 1, 203, 2, 1, 16, 16, 8, 4, 8, 5, 8
    x = make_inputs(B, T, HQ, H, dk, dv, l, d, torch.float32, seed=3)
    args = [x[n].detach() for n in NAMES]
    kw = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    with torch.no_grad():
        o, bi = nsa_attention_triton(*args, **kw)
        ro, rbi = nsa_reference(*[a.double().cpu() for a in args], **kw)
    assert torch.equal(bi.cpu(), rbi)
    assert rel_err(o, ro) <= tol(torch.float32)
    # the ranking really chose non-forced blocks somewhere
    cur = torch.arange(T) // l_sel
    forced = (rbi[0, :, 0, :, None] == torch.stack([cur, cur * 0, cur - 1], -1)[:, None, :]).any(-1)
    assert ((rbi[0, :, 0] >= 0) & ~forced).any()


def test_block_scores_kernel_matches_reference():
    B, T, HQ, H, dk, l, d, l_sel = 1, 150, 6, 2, 16, 12, 4, 8
    G = HQ // H
    p = common.NSAParams(l, d, l_sel, 4, 16)
    x = make_inputs(B, T, HQ, H, dk, dk, l, d, torch.float32, seed=11)
    q, kc = x["q"].detach(), x["k_cmp"].detach()
    scale = dk ** -0.5
    # lse of the compressed branch in fp64 ([B, T, HQ]); -inf where nothing is visible
    logits = torch.einsum("bthk,bnhk->bthn", q.double().cpu(),
                          kc.double().cpu().repeat_interleave(G, 2)) * scale
    vis = (torch.arange(kc.shape[1]) * d + l - 1)[None, :] <= torch.arange(T)[:, None]   # [T, N]
    logits = logits.masked_fill(~vis[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    sc = tsu.block_scores(q, kc, lse.float().to(DEV), l=l, d=d, l_sel=l_sel, scale=scale)
    assert sc.shape == (B, H, T, triton.cdiv(T, l_sel))
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]))                          # [B,T,HQ,N]
    for t in (0, l - 1, l, 37, 64, 99, T - 1):
        nb = t // l_sel + 1
        n_vis = common.visible_cmp(t, l, d)
        pc = probs[:, t, :, :n_vis].reshape(B, H, G, n_vis)
        ref = reference_block_scores(pc, nb, p)
        got = sc[:, :, t, :nb].double().cpu()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7), t


def test_topn_kernel_ties_forced_and_padding():
    """Exact ties, all-zero rows, n_sel > eligible blocks and n_sel < forced blocks."""
    B, H, T, l, d, l_sel, G = 1, 3, 70, 8, 4, 8, 2
    nsb = triton.cdiv(T, l_sel)
    gen = torch.Generator().manual_seed(5)
    sc = torch.rand(B, H, T, nsb, generator=gen)
    sc[0, 1] = torch.randint(0, 3, (T, nsb), generator=gen).float() / 7.0   # many exact ties
    sc[0, 2] = 0.0                                                              # everything tied
    for n_sel in (1, 2, 4, 12):
        p = common.NSAParams(l, d, l_sel, n_sel, 16)
        bi = tsu.select_topn(sc.to(DEV), G=G, l=l, d=d, l_sel=l_sel, n_sel=n_sel).cpu()
        for h in range(H):
            for t in range(T):
                want = reference_select_one(sc[0, h, t].double().tolist(), t, p, G)
                assert bi[0, t, h].tolist() == want, (n_sel, h, t)


def test_poisoning_is_active():
    assert torch.empty(3).isnan().all() and (torch.empty(2, dtype=torch.int64) == -7).all()


def test_triton_available_reports_device():
    assert triton_available() == torch.cuda.is_available()


def test_unsupported_dtype_and_bad_shapes():
    x = make_inputs(1, 20, 2, 1, 16, 16, 8, 4, torch.float32, seed=1)
    args = [x[n].detach() for n in NAMES]
    with pytest.raises(NotImplementedError, match="dtype"):
        nsa_attention_triton(*[a.double() for a in args[:7]], args[7], l=8, d=4, l_sel=8, n_sel=2, w=8)
    with pytest.raises(ValueError, match="k_cmp"):
        nsa_attention_triton(*args, l=8, d=2, l_sel=8, n_sel=2, w=8)   # wrong N for this d
    with pytest.raises(ValueError, match="l_sel"):
        nsa_attention_triton(*args, l=8, d=4, l_sel=6, n_sel=2, w=8)


def test_package_imports_without_triton():
    import subprocess
    import sys
    code = ("import sys; sys.modules['triton'] = None; import nsa.ops.triton as t; "
            "assert not t.triton_importable() and not t.triton_available(); print('ok')")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@triton.jit
def _nested_row_sum(x):
    return tl.sum(x, axis=0)            # tl.sum: a standard-library @jit whose globals hold tl.core, not tl


@triton.jit
def _row_sums_kernel(X, Y, N: tl.constexpr):
    i = tl.program_id(0)
    ones = tl.full([N], 1.0, tl.float32)
    tl.store(Y + i, _nested_row_sum(tl.load(X + i * N + tl.arange(0, N))) + _nested_row_sum(ones))


@pytest.mark.skipif(DEV == "cuda", reason="interpreter only")
def test_interpreter_skips_repeated_patches_exactly():
    """conftest's interpreter speed-up is installed (a Triton without the internals it wraps leaves the
    kernel tests correct but twice as slow: this says so), nested @jit calls (ours, tl.sum) give the
    right values, and after the launch triton.language is restored to exactly what it was."""
    from triton.runtime import interpreter as ti
    assert getattr(ti._patch_lang, "skips_repeats", False), "tests/conftest.py: interpreter speed-up not installed"
    before = dict(vars(tl))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    for _ in range(2):                  # the second launch starts from the first one's leftovers
        y = torch.full((5,), float("nan"))
        _row_sums_kernel[(5,)](x, y, N=16)
        assert torch.allclose(y, x.sum(1) + 16.0, atol=1e-5)
    assert dict(vars(tl)) == before
