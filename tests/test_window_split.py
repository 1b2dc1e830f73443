"""The window branch's backward with each KV head's query heads as batches (nsa/ops/window_split.py).

On the CPU "reference" (fp32 / fp64 math) stands in for FlashAttention-4 in both passes, so these tests check
what the module adds: the grouped views, the way back to q's layout, the batch sum of dK / dV, the policy and
the fallback. On a GPU with FA4 the split backward is compared with the GQA one against fp32 math."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from nsa.ops import dispatch, fallbacks, flash, window_split  # noqa: E402
from nsa.ops.testing import rel_rms  # noqa: E402


def _inputs(T, HQ, H, d, dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype).requires_grad_()  # noqa: E731
    return mk(1, T, HQ, d), mk(1, T, H, d), mk(1, T, H, dv), torch.randn(1, T, HQ, dv, generator=g).to(device, dtype)


@pytest.mark.parametrize("HQ,H,w", [(4, 2, 7), (32, 2, 5), (6, 3, 64)], ids=["G2", "G16", "G2_w_over_T"])
def test_split_backward_equals_the_gqa_backward_fp64(HQ, H, w):
    """Same output and the same dq / dk / dv (fp64: to rounding) as the plain GQA call, odd T, d_k != d_v."""
    q, k, v, do = _inputs(37, HQ, H, 16, 8, torch.float64)
    o = window_split.window_attention_split(q, k, v, w, 0.3, "reference")
    g = torch.autograd.grad(o, (q, k, v), do)
    ro = flash.dense_attention(q, k, v, causal=True, window=w, scale=0.3, backend="reference")
    rg = torch.autograd.grad(ro, (q, k, v), do)
    torch.testing.assert_close(o, ro, rtol=0, atol=0)
    for name, a, b in zip("qkv", g, rg):
        assert a.shape == b.shape and a.is_contiguous(), name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"d{name}")


def test_batch_sum_adds_the_batches_in_fp32():
    """bf16 partials whose sum is exact in bf16 too (multiples of 1/4, |sum| <= 32), so no conversion
    rounds: the kernel's result equals the fp32 sum bit for bit; T * H * d not a multiple of the block."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(-8, 9, (16, 19, 3, 24), generator=g).float() / 4).to(torch.bfloat16)
    y = window_split.batch_sum(x)
    assert y.shape == (1, 19, 3, 24) and y.dtype == torch.bfloat16
    assert torch.equal(y, x.float().sum(0, keepdim=True).to(torch.bfloat16))


def split_planned(min_t, **inputs) -> bool:
    """Whether the plan (nsa/ops/plan.py) gives a T = 64, HQ = 8, H = 2 call the split window backward."""
    import dataclasses
    from nsa.ops.plan import PlanInputs, select_plan
    from nsa.ops.tuning import CPU, FlashBranchTuning
    inp = dataclasses.replace(PlanInputs("cpu", "float32", 1, 64, 8, 2, 16, 16, 4), **inputs)
    tn = CPU.replace(flash=FlashBranchTuning(win="reference", win_split_min_t=min_t))
    return select_plan(inp, tn).win_entry == "split"


def test_split_policy():
    """Only B == 1, G > 1, contiguous q, from win_split_min_t on, and not after a failure on the device."""
    assert split_planned(0) and split_planned(64)
    assert not split_planned(None) and not split_planned(65)
    assert not split_planned(0, B=2)                                                  # B > 1
    assert not split_planned(0, HQ=2)                                                 # G = 1
    assert not split_planned(0, layout=frozenset({"q_heads", "kv_rows"}))             # strided q
    assert not split_planned(0, refused=frozenset({"win_entry"}))                     # failed here
    from nsa.ops.tuning import FlashBranchTuning
    with pytest.raises(ValueError, match="win_split_min_t"):
        FlashBranchTuning(win="auto", win_split_min_t=-1)


def test_split_failure_falls_back_to_the_gqa_backward(monkeypatch):
    """The private backward raising: the same gradients from the public path, counted, warned, and the
    device off the split path from then on."""
    def boom(*a, **k):
        raise RuntimeError("private API changed")

    monkeypatch.setattr(window_split, "flash_bwd", boom)
    monkeypatch.setattr(fallbacks, "_refused", {})   # this test's refusals only
    dispatch.reset_fallback_counts()
    q, k, v, do = _inputs(21, 4, 2, 16, 16, torch.float32)
    o = window_split.window_attention_split(q, k, v, 5, 0.25, "reference")
    with pytest.warns(RuntimeWarning, match="backward entry failed"):
        g = torch.autograd.grad(o, (q, k, v), do)
    rg = torch.autograd.grad(flash.dense_attention(q, k, v, window=5, scale=0.25, backend="reference"), (q, k, v), do)
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b)
    assert dispatch.fallback_counts() == {"win_split:reference->gqa": 1}
    from nsa.ops.plan import _refused
    assert "win_entry" in _refused(str(q.device), q.dtype, 16, 16)   # the plan takes the split away from now on


@pytest.mark.parametrize("accum", [True, False])
def test_the_op_takes_the_split_backward_where_the_policy_says(monkeypatch, accum):
    """nsa_triton_apply with the window on "reference": the split path from win_split_min_t on (B = 1),
    below it the unsplit one through the same Function (FlashBranchTuning.fa4_accum) or flash-attn's
    public path, with the same output and gradients."""
    from nsa.ops.testing import make_inputs
    from nsa.ops.triton.function import nsa_triton_apply
    from nsa.ops.tuning import FlashBranchTuning, tuning_for

    calls = []
    real = window_split.window_attention_split
    monkeypatch.setattr(window_split, "window_attention_split",
                        lambda *a: calls.append((a[0].shape[1], a[7])) or real(*a))
    x = make_inputs(1, 45, 4, 2, 16, 16, l=8, d=4, seed=4)
    res = []
    for min_t in (46, 45):
        tuning = tuning_for("cpu").replace(flash=FlashBranchTuning(win="reference", win_split_min_t=min_t,
                                                                   fa4_accum=accum))
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25, tuning=tuning)
        res.append((o, torch.autograd.grad(o, args, torch.ones_like(o))))
    assert calls == ([(45, False)] if accum else []) + [(45, True)]
    assert rel_rms(res[0][0], res[1][0]) == 0
    for a, b in zip(res[0][1], res[1][1]):
        assert rel_rms(a, b) <= 1e-6


def test_the_op_hands_row_sums_to_both_flash_branches(monkeypatch):
    """FlashBranchTuning.row_sums: the compressed branch and the split window (both on "reference") get D
    from the NSA backward's gate gradients (nsa/ops/branch_sums.py) and never read o (NaN here when D
    came); output and every gradient equal the op without it to rounding, so D's layouts ([B, HQ', N]
    through the dense problem's lse slots; [1, HQ, T] -> [G, H, T]) are right. B = 1, odd T, G = 2."""
    from nsa.ops import branch_sums
    from nsa.ops.testing import make_inputs
    from nsa.ops.triton.function import nsa_triton_apply
    from nsa.ops.tuning import FlashBranchTuning, tuning_for

    seen = []
    real = branch_sums.flash_bwd

    def spy(backend, q, k, v, o, do, lse, d_rows, **kw):
        seen.append((tuple(q.shape), d_rows is not None))
        if d_rows is not None:
            o = torch.full_like(o, float("nan"))
        return real(backend, q, k, v, o, do, lse, d_rows, **kw)

    monkeypatch.setattr(branch_sums, "flash_bwd", spy)
    monkeypatch.setattr(window_split, "flash_bwd", spy)
    x = make_inputs(1, 45, 4, 2, 16, 16, l=8, d=4, seed=5)
    res = []
    for on in (True, False):
        seen.clear()
        flash_t = FlashBranchTuning(win="reference", cmp="reference", win_split_min_t=0, row_sums=on)
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25,
                                tuning=tuning_for("cpu").replace(flash=flash_t))
        res.append((o, torch.autograd.grad(o, args, torch.randn(o.shape, generator=torch.Generator().manual_seed(1)))))
        # the window's grouped problem [G, T, H, d], and with row sums the compressed one [1, N, HQ', d]
        # through branch_sums (without: its autograd as before)
        assert sorted(seen) == sorted([((2, 45, 2, 16), on)] + [((1, 10, 16, 16), on)] * on), seen
    assert rel_rms(res[0][0], res[1][0]) == 0
    for name, a, b in zip("q k_cmp v_cmp k_slc v_slc k_win v_win gates".split(), res[0][1], res[1][1]):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-6, name


@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_the_window_gate_folded_into_lse(monkeypatch, split):
    """FlashBranchTuning.win_gate_lse: the window's backward gets the op's dO itself (the gate kernel writes
    no g_win * dO), D = dg_win and lse - ln g_win, and every gradient equals the op with the gate applied to
    dO, to rounding; gates of exactly 0 on some rows (ln g = -inf: those rows add nothing). Then the same
    with FA4's entry failing: the public path scales dO by the gate itself."""
    from nsa.ops.testing import make_inputs
    from nsa.ops.triton.function import nsa_triton_apply
    from nsa.ops.tuning import FlashBranchTuning, tuning_for

    seen = []
    real = window_split.flash_bwd

    def spy(backend, q, k, v, o, do, lse, d_rows, **kw):
        seen.append((do, kw.get("lse_shift")))
        return real(backend, q, k, v, o, do, lse, d_rows, **kw)

    monkeypatch.setattr(window_split, "flash_bwd", spy)
    x = list(make_inputs(1, 45, 4, 2, 16, 16, l=8, d=4, seed=6))
    x[7] = x[7].detach().clone()
    x[7][0, 3:9, 1, 2] = 0   # [B, T, HQ, 3]: the window gate of head 1 off on six rows
    dout = torch.randn(1, 45, 4, 16, generator=torch.Generator().manual_seed(2))

    def run(fold: bool):
        seen.clear()
        flash_t = FlashBranchTuning(win="reference", cmp="reference", win_split_min_t=0 if split else None,
                                    win_gate_lse=fold)
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25,
                                tuning=tuning_for("cpu").replace(flash=flash_t))
        return o, torch.autograd.grad(o, args, dout)

    o1, g1 = run(True)
    (do, shift), = seen
    assert shift is not None and torch.isneginf(shift).sum() == 6
    # the op's dO, in the split's grouped view [G, T, H, d] (batch g, head h = query head h*G + g) or as is
    want = dout.view(45, 2, 2, 16).permute(2, 0, 1, 3) if split else dout
    assert torch.equal(do, want)
    o0, g0 = run(False)
    (do0, shift0), = seen
    assert shift0 is None and not torch.equal(do0, want)
    assert rel_rms(o1, o0) == 0
    names = "q k_cmp v_cmp k_slc v_slc k_win v_win gates".split()
    for name, a, b in zip(names, g1, g0):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-6, name

    def boom(*a, **k):
        raise RuntimeError("private API changed")

    monkeypatch.setattr(window_split, "flash_bwd", boom)
    monkeypatch.setattr(fallbacks, "_refused", {})
    with pytest.warns(RuntimeWarning, match="backward entry failed"):
        _, gp = run(True)
    for name, a, b in zip(names, gp, g0):
        assert rel_rms(a, b) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_split_backward_against_fp32_math(T):
    """FA4, paper shape (HQ=64, H=4, d=128), bf16, w=512: the split backward's dq / dk / dv on KV head 0
    within the bf16 bound of fp32 math and close to the GQA backward's own error (dK / dV carry G
    roundings instead of one); the output is the GQA forward's, bit for bit."""
    be, why = flash.branch_flash_backend("win", flash_tuning(), torch.zeros(1, 1, 1, 128, device="cuda",
                                                                             dtype=torch.bfloat16), 128)
    if be != "fa4":
        pytest.skip(f"fa4 not usable here: {why}")
    q, k, v, do = _inputs(T, 64, 4, 128, 128, torch.bfloat16, "cuda")
    sc, w, G = 128 ** -0.5, 512, 16
    o = window_split.window_attention_split(q, k, v, w, sc, "fa4")
    got = torch.autograd.grad(o, (q, k, v), do)
    ro = flash.dense_attention(q, k, v, window=w, scale=sc, backend="fa4")
    gqa = torch.autograd.grad(ro, (q, k, v), do)
    assert torch.equal(o, ro)
    n = min(T - w, 8192)   # fp32 math on the last n queries of KV head 0 (their keys: the last n + w)
    qs = q[0, -n:, :G].detach().float().transpose(0, 1).requires_grad_()
    ks, vs = (t[0, -(n + w):, 0].detach().float().requires_grad_() for t in (k, v))
    i = torch.arange(n, device="cuda")[:, None] + w
    j = torch.arange(n + w, device="cuda")[None, :]
    p = torch.softmax(((qs @ ks.T) * sc).masked_fill(~((j <= i) & (j > i - w)), float("-inf")), -1)
    dqs, dks, dvs = torch.autograd.grad(p @ vs, (qs, ks, vs), do[0, -n:, :G].float().transpose(0, 1))
    # keys before the slice's first query also get gradients from earlier queries: compare the last n keys
    truth = (dqs.transpose(0, 1), dks[w:], dvs[w:])
    for name, a, b in zip("qkv", got, gqa):
        pick = (lambda t: t[0, -n:, :G]) if name == "q" else (lambda t: t[0, -n:, 0])
        ea = rel_rms(pick(a).float(), truth["qkv".index(name)])
        eb = rel_rms(pick(b).float(), truth["qkv".index(name)])
        assert ea <= 5e-3 and ea <= 1.3 * eb + 1e-4, f"d{name}: split {ea:.2e}, gqa {eb:.2e}"


def flash_tuning():
    from nsa.ops.tuning import FlashBranchTuning
    return FlashBranchTuning(win="auto")
