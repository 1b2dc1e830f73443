"""Dense-attention backends on a GPU (nsa/ops/flash.py): every backend that can run here against the fp64
reference, forward and every gradient, within the usual bf16 bound (1.5 x the noise floor of eager bf16
attention, nsa.ops.testing.lowp_attention_error); and the choice: flash-attn where installed, never with
allow_flash=False. Skipped without CUDA; a backend this GPU or install lacks is skipped with its reason."""
from __future__ import annotations

import pytest
import torch

from nsa.ops import KernelPolicy, flash
from nsa.ops.testing import lowp_attention_error, rel_rms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
ALL = flash.FLASH_BACKENDS + flash.SDPA_BACKENDS + ("sdpa",)


def _need(backend: str, dtype: torch.dtype, d: int) -> None:
    if backend == "sdpa":
        return
    why = flash.ineligible(backend, DEV, dtype, d, allow_flash=True)
    if why is not None:
        pytest.skip(f"{backend}: {why}")


def _inputs(B, Tq, Tk, HQ, H, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(*s, generator=g) for s in ((B, Tq, HQ, d), (B, Tk, H, d), (B, Tk, H, d),
                                                           (B, Tq, HQ, d)))
    low = [t.to(DEV, dtype) for t in (q, k, v)]
    ref = [t.cpu().double().requires_grad_() for t in low]  # the same bf16-rounded values, in fp64 on CPU
    return [t.requires_grad_() for t in low], ref, do


def _bound(d: int) -> tuple[float, float]:
    tol_o, tol_g = lowp_attention_error(torch.bfloat16, T=256, HQ=12, H=2, dk=d, dv=d)
    return 1.5 * tol_o, 1.5 * tol_g


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("backend", ALL)
def test_backend_matches_reference_forward_and_gradients(backend, window, d):
    """B=2, T=1000 (not a multiple of any tile), 12 query heads over 2 KV heads, bf16, causal. (sdpa_cudnn
    and sdpa_flash take no explicit mask: with a window they run through torch's dispatcher.)"""
    _need(backend, torch.bfloat16, d)
    x, xr, do = _inputs(2, 1000, 1000, 12, 2, d, torch.bfloat16, seed=d + (window or 0))
    o = flash.dense_attention(*x, causal=True, window=window, backend=backend)
    o_r, _ = flash.reference_attention(*xr, causal=True, window=window)
    g = torch.autograd.grad(o, x, do.to(DEV, torch.bfloat16))
    g_r = torch.autograd.grad(o_r, xr, do.double())
    tol_o, tol_g = _bound(d)
    assert o.dtype == torch.bfloat16 and o.shape == (2, 1000, 12, d)
    assert rel_rms(o.cpu(), o_r) <= tol_o, backend
    for name, a, b in zip(("dq", "dk", "dv"), g, g_r):
        assert rel_rms(a.cpu(), b) <= tol_g, f"{backend} {name}"


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("Tq", [1, 7])
def test_decode_shapes_are_bottom_right_causal(backend, Tq):
    """Tq new queries after 993 cached keys: query i sits at position 1000 - Tq + i."""
    _need(backend, torch.bfloat16, 64)
    x, xr, _ = _inputs(1, Tq, 1000, 12, 2, 64, torch.bfloat16, seed=Tq)
    o = flash.dense_attention(*x, causal=True, backend=backend)
    o_r, _ = flash.reference_attention(*xr, causal=True)
    assert rel_rms(o.detach().cpu(), o_r) <= _bound(64)[0]


def test_choice_prefers_flash_when_installed_and_never_when_disabled():
    flash.reset_choices()
    name, why = flash.choose_dense_backend(DEV, torch.bfloat16, 64, allow_flash=True)
    installed = [b for b in flash.FLASH_BACKENDS if flash.ineligible(b, DEV, torch.bfloat16, 64, True) is None]
    if installed:
        assert name == installed[0], why
    assert "skipped" in why or name == "fa4"
    off, why_off = flash.choose_dense_backend(DEV, torch.bfloat16, 64, allow_flash=False)
    assert off not in flash.FLASH_BACKENDS and "nsa.allow_flash_attn=false" in why_off
    pol = KernelPolicy.resolve(DEV, torch.bfloat16, "auto", allow_flash=False, head_dim=64)
    assert pol.backends["dense"] == off and f"dense={off}" in str(pol)
    # fp32 inputs: flash-attn does not apply (bf16/fp16 only)
    assert flash.choose_dense_backend(DEV, torch.float32, 64, allow_flash=True)[0] not in flash.FLASH_BACKENDS


def test_nsa_model_policy_line_names_flash_branches():
    """An NSA model on this GPU's preset: its policy phrase names the branches on flash-attn when one is
    installed and the preset moves them, and none with allow_flash=False."""
    from nsa.ops.tuning import FlashBranchTuning, tuning_for
    cfg = tuning_for(DEV).flash
    if cfg.win == "off" and cfg.cmp == "off":
        cfg = FlashBranchTuning(win="auto", cmp="auto")   # the phrase for a preset that moves both
    line = flash.branch_summary(DEV, torch.bfloat16, 64, True, cfg)
    if flash.choose_dense_backend(DEV, torch.bfloat16, 64, True)[0] in flash.FLASH_BACKENDS:
        assert " branch on fa" in line, line
    assert flash.branch_summary(DEV, torch.bfloat16, 64, False, cfg).endswith("(nsa.allow_flash_attn=false)")


@pytest.mark.parametrize("backend", flash.FLASH_BACKENDS)
def test_nsa_branch_hooks_on_flash(backend):
    """The NSA window branch (query t sees t-w+1..t) = dense_attention(window=w); flash_sdpa_lse =
    cmp_dense._sdpa_lse's contract ([B, H, N, D], top-left causal over a square problem)."""
    _need(backend, torch.bfloat16, 64)
    x, xr, _ = _inputs(2, 700, 700, 12, 2, 64, torch.bfloat16, seed=5)
    o = flash.dense_attention(*x, causal=True, window=96, scale=0.125, backend=backend)
    o_r, _ = flash.reference_attention(*xr, causal=True, window=96, scale=0.125)
    assert rel_rms(o.detach().cpu(), o_r) <= _bound(64)[0]
    qh, kh, vh = (t.detach().transpose(1, 2) for t in x)
    o2, lse2 = flash.flash_sdpa_lse(qh, kh, vh, 0.125, backend)
    assert rel_rms(o2.transpose(1, 2).cpu(), flash.reference_attention(*xr, causal=True, scale=0.125)[0]) \
        <= _bound(64)[0]
    assert lse2.shape == (2, 12, 700)


def test_dense_twin_layer_on_its_chosen_kernel():
    """Under bf16 autocast the layer runs its chosen kernel on its own bf16 q/k/v: that kernel's output
    is within the bound of the fp64 reference on the same q/k/v, and the layer is o_proj of it."""
    from nsa.layers.dense import DenseAttention
    torch.manual_seed(0)
    layer = DenseAttention(768, 12, 2, 64, 64).to(DEV)
    x = torch.randn(2, 1000, 768, device=DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        y = layer(x)
        q, k, v = layer.project(x)
        be = layer.kernel(q)
        o = flash.dense_attention(q, k, v, causal=True, scale=0.125, backend=be)
        assert torch.equal(y, layer.o_proj(o.reshape(2, 1000, 768))), be
    o_r, _ = flash.reference_attention(*(t.cpu().double() for t in (q, k, v)), causal=True, scale=0.125)
    assert rel_rms(o.cpu(), o_r) <= _bound(64)[0], be
