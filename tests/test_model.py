"""LlamaBlockNSA and TinyLM: shapes, causality, checkpointing, config plumbing, dtypes."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import nsa
from nsa import LlamaBlockNSA, NSAAttention, TinyLM

NSA = dict(l=8, d=4, l_sel=8, n_sel=3, w=16)
MODEL = dict(vocab=61, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, **NSA)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(seed: int = 0, **over) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**{**MODEL, "backend": "torch", **over})


def test_package_exports_are_light():
    assert nsa.NSAAttention is NSAAttention and nsa.TinyLM is TinyLM
    assert nsa.LlamaBlockNSA is LlamaBlockNSA
    import subprocess
    import sys
    code = "import sys, nsa; print(any(m in sys.modules for m in ('ray', 'mlflow')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=str(__import__("pathlib").Path(nsa.__file__).parents[1]))
    assert out.stdout.strip() == "False"


def test_block_shape_and_residual_path():
    torch.manual_seed(0)
    blk = LlamaBlockNSA(dim=32, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, backend="torch", **NSA)
    x = torch.randn(2, 19, 32)
    y = blk(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    # pre-norm: the attention branch sees norm(x), so it is blind to the input's scale
    a1 = blk.attn(blk.attn_norm(x))
    assert torch.allclose(blk.attn(blk.attn_norm(3 * x)), a1, atol=1e-5)
    # residuals: with both branch output projections zeroed the block is the identity
    with torch.no_grad():
        blk.attn.o_proj.weight.zero_()
        blk.mlp.down.weight.zero_()
    assert torch.equal(blk(x), x)


def test_tinylm_causality_by_perturbation():
    model = make_model().eval()
    torch.manual_seed(1)
    T, t = 45, 26
    ids = torch.randint(0, MODEL["vocab"], (2, T))
    ids2 = ids.clone()
    ids2[:, t + 1:] = (ids2[:, t + 1:] + 7) % MODEL["vocab"]
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    assert a.shape == (2, T, MODEL["vocab"]) and a.dtype == torch.float32
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])


def test_grad_checkpointing_matches_plain_backward():
    torch.manual_seed(2)
    ids = torch.randint(0, MODEL["vocab"], (2, 33))
    grads = []
    for ckpt in (False, True):
        model = make_model(seed=3, grad_checkpointing=ckpt).train()
        loss = torch.nn.functional.cross_entropy(
            model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5), name
        assert torch.isfinite(grads[0][name]).all(), name


def test_from_config_duck_typed_and_helpers():
    mcfg = SimpleNamespace(vocab_size=50, dim=32, n_layers=3, n_heads=6, n_kv_groups=3, d_k=8,
                           d_v=4, tie_embeddings=True, unrelated_field=1)
    ncfg = SimpleNamespace(l=8, d=4, l_sel=16, n_sel=2, w=32, compression="mean", backend="torch")
    model = TinyLM.from_config(mcfg, ncfg, grad_checkpointing=True)
    assert model.vocab == 50 and model.n_layers == 3 and model.grad_checkpointing
    assert model.lm_head.weight is model.embed.weight
    layers = model.nsa_layers()
    assert len(layers) == 3 and all(isinstance(m, NSAAttention) for m in layers)
    a = layers[0]
    assert (a.n_heads, a.n_kv_groups, a.d_v, a.l_sel, a.w, a.compression, a.backend) == \
        (6, 3, 4, 16, 32, "mean", "torch")
    with pytest.raises(ValueError, match="unknown overrides"):
        TinyLM.from_config(mcfg, ncfg, not_a_field=1)
    model.set_record_stats(True)
    ids = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        model(ids)
    for m in layers:
        assert m.record_stats and m.last_gates.shape == (2, 20, 6, 3)
        assert m.last_block_idx.shape == (2, 20, 3, 2)
    model.set_record_stats(False)
    assert not any(m.record_stats for m in layers)


def test_from_config_with_project_dataclasses():
    cfg = pytest.importorskip("nsa.config")
    model = TinyLM.from_config(cfg.ModelConfig(dim=32, n_heads=4, n_kv_groups=2, d_k=8, d_v=8),
                               cfg.NSAConfig(l=8, d=4, l_sel=8, n_sel=2, w=16, backend="torch"))
    assert model.dim == 32 and model.nsa_layers()[0].w == 16
    with torch.no_grad():
        assert model(torch.randint(0, model.vocab, (1, 12))).shape == (1, 12, model.vocab)


@pytest.mark.parametrize("T", [3, 7, 20])
def test_bf16_model_finite(T):
    model = make_model().to(torch.bfloat16).eval()
    ids = torch.randint(0, MODEL["vocab"], (2, T))
    with torch.no_grad():
        logits = model(ids)
        gen = model.generate(ids, 5)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert gen.shape == (2, T + 5)


def test_autocast_bf16_training_step_finite():
    model = make_model().train()
    ids = torch.randint(0, MODEL["vocab"], (2, 6))  # T < l: the compressed branch is empty
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("field,value", [("vocab", 0), ("n_layers", 0), ("n_kv_groups", 3),
                                         ("l_sel", 10), ("compression", "sum"), ("ffn_mult", 0.0)])
def test_bad_model_args_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}="):
        TinyLM(**{**MODEL, field: value})


def test_bad_ids_rejected():
    model = make_model()
    with pytest.raises(ValueError, match="ids"):
        model(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="ids"):
        model(torch.zeros(2, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_is_the_fp32_formula_whichever_kernel_runs(dtype):
    """RMSNorm: x * rsqrt(mean(x^2) + eps) * weight in fp32, cast to x's dtype, forward and both gradients, whether
    the fused torch kernel (fp32 input and weight) or the elementwise path (bf16 input) runs it."""
    from nsa.model import RMSNorm
    torch.manual_seed(0)
    norm = RMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(2, 5, 24) * 3).to(dtype).requires_grad_()
    y = norm(x)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight).to(dtype)
    assert y.dtype == dtype and torch.allclose(y.float(), want.float(), rtol=1e-6, atol=1e-6)
    dy = torch.randn_like(y)
    got, ref = torch.autograd.grad(y, [x, norm.weight], dy), torch.autograd.grad(want, [x, norm.weight], dy)
    assert all(torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5) for a, b in zip(got, ref))
