"""NSAAttention, RoPE and compression (CPU, small shapes, backend "torch")."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nsa import NSAAttention
from nsa.layers.compression import BlockCompressor, num_compressed, unfold_blocks
from nsa.layers.rope import apply_rope

CFG = dict(dim=32, n_heads=4, n_kv_groups=2, d_k=8, d_v=12, l=8, d=4, l_sel=8, n_sel=3, w=16)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_layer(seed: int = 0, **over) -> NSAAttention:
    torch.manual_seed(seed)
    kw = {**CFG, "backend": "torch", **over}
    return NSAAttention(**kw)


def force_gates(layer: NSAAttention, branch: int) -> None:
    """Test hook: replace the gate MLP's output by a one-hot gate on `branch` (0 cmp, 1 slc, 2 win)."""
    def gates(x: torch.Tensor) -> torch.Tensor:
        g = torch.zeros(*x.shape[:2], layer.n_heads, 3, dtype=x.dtype, device=x.device)
        g[..., branch] = 1.0
        return g
    layer.compute_gates = gates  # instance attribute shadows the method


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int | None = None
                     ) -> torch.Tensor:
    """Plain (optionally windowed) causal GQA attention in fp64: q [B,T,HQ,dk], k/v [B,T,H,*]."""
    G = q.shape[2] // k.shape[2]
    qh = q.double().transpose(1, 2)
    kh = k.double().repeat_interleave(G, dim=2).transpose(1, 2)
    vh = v.double().repeat_interleave(G, dim=2).transpose(1, 2)
    T = q.shape[1]
    t = torch.arange(T)
    mask = t[None, :] <= t[:, None]
    if w is not None:
        mask &= t[None, :] > t[:, None] - w
    s = (qh @ kh.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    return (p @ vh).transpose(1, 2)  # [B, T, HQ, dv]


# ---------------------------------------------------------------------------------------- RoPE
def test_rope_offset_matches_absolute_positions_and_keeps_dtype():
    torch.manual_seed(0)
    x = torch.randn(2, 20, 3, 8)
    full = apply_rope(x)
    assert torch.allclose(apply_rope(x[:, 7:], offset=7), full[:, 7:], atol=1e-6)
    assert torch.allclose(full.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation
    assert torch.equal(full[:, 0], x[:, 0])  # position 0 is the identity
    xb = x.bfloat16()
    outb = apply_rope(xb, offset=5000)
    assert outb.dtype == torch.bfloat16
    # angles in fp32: the bf16 result is the rounded fp32 result
    ref = apply_rope(xb.float(), offset=5000).bfloat16()
    assert torch.equal(outb, ref)


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (apply_rope(q, offset=10) * apply_rope(k, offset=3)).sum()
    s2 = (apply_rope(q, offset=110) * apply_rope(k, offset=103)).sum()
    assert torch.allclose(s1, s2, atol=1e-4)


# --------------------------------------------------------------------------------- compression
@pytest.mark.parametrize("T,expected", [(0, 0), (7, 0), (8, 1), (11, 1), (12, 2), (29, 6)])
def test_num_compressed_and_empty(T, expected):
    assert num_compressed(T, 8, 4) == expected
    phi = BlockCompressor(6, 8, 4, kind="mlp")
    out = phi(torch.randn(2, T, 3, 6))
    assert out.shape == (2, expected, 3, 6)


def test_compression_blocks_cover_their_tokens_only():
    torch.manual_seed(0)
    l, d, T = 8, 4, 29
    x = torch.randn(1, T, 2, 6)
    blocks = unfold_blocks(x, l, d)  # [1, N, 2, l, 6]
    for i in range(blocks.shape[1]):
        assert torch.equal(blocks[0, i].transpose(0, 1), x[0, i * d: i * d + l])
    mean = BlockCompressor(6, l, d, kind="mean")(x)
    assert torch.allclose(mean[0, 3], x[0, 12:20].mean(0), atol=1e-6)
    # the MLP compressor reads only its block: perturb token 13 -> blocks 2 (8..15), 3 (12..19) move
    phi = BlockCompressor(6, l, d, kind="mlp")
    y0 = phi(x)
    x2 = x.clone()
    x2[0, 13] += 1.0
    changed = (phi(x2) - y0).abs().amax(dim=(0, 2, 3)) > 0
    assert changed.tolist() == [i in (2, 3) for i in range(y0.shape[1])]


def test_compression_init_near_block_mean_and_single_block():
    torch.manual_seed(0)
    x = torch.randn(2, 40, 3, 16)
    mean = BlockCompressor(16, 8, 4, kind="mean")(x)
    lin = BlockCompressor(16, 8, 4, kind="linear")(x)
    assert torch.allclose(lin, mean, atol=1e-5)  # exact block mean at init
    phi = BlockCompressor(16, 8, 4, kind="mlp")
    out = phi(x)
    assert (out - mean).norm() < 0.1 * mean.norm()
    # decode: compress one newly completed block == the batched result for that block
    i = 5
    one = phi.compress_block(x[:, i * 4: i * 4 + 8])
    assert torch.allclose(one[:, 0], out[:, i], atol=1e-6)


# ----------------------------------------------------------------------------- NSAAttention
def test_forward_shape_and_causality_by_perturbation():
    layer = make_layer()
    torch.manual_seed(3)
    T, t = 37, 21
    x = torch.randn(2, T, CFG["dim"])
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    x2 = x.clone()
    x2[:, t + 1:] = torch.randn_like(x2[:, t + 1:]) * 3
    y2 = layer(x2)
    assert torch.equal(y[:, : t + 1], y2[:, : t + 1])
    assert not torch.allclose(y[:, t + 1:], y2[:, t + 1:])


def test_return_branches_sum_and_record_stats():
    layer = make_layer(n_heads=6, n_kv_groups=2)
    torch.manual_seed(4)
    B, T = 2, 30
    x = torch.randn(B, T, CFG["dim"])
    layer.record_stats = True
    y, info = layer(x, return_branches=True)
    HQ, H = layer.n_heads, layer.n_kv_groups
    g = info["gates"]
    assert g.shape == (B, T, HQ, 3) and ((g > 0) & (g < 1)).all()
    assert info["block_idx"].shape == (B, T, H, CFG["n_sel"])
    assert info["block_idx"].dtype == torch.int64
    o = sum(g[..., i: i + 1] * info[f"o_{n}"] for i, n in enumerate(("cmp", "slc", "win")))
    for n in ("cmp", "slc", "win"):
        assert info[f"o_{n}"].shape == (B, T, HQ, CFG["d_v"])
    assert torch.allclose(layer.o_proj(o.reshape(B, T, -1)), y, atol=1e-5)
    # stats: detached, right shapes, equal to the returned ones; plain forward is one result
    assert layer.last_gates.shape == (B, T, HQ, 3) and not layer.last_gates.requires_grad
    assert torch.equal(layer.last_block_idx, info["block_idx"])
    assert torch.equal(layer(x), y)
    # at init the gates sit near 0.5
    assert (g - 0.5).abs().max() < 0.1


@pytest.mark.parametrize("G", [1, 3])
def test_full_coverage_window_equals_causal_attention(G):
    layer = make_layer(n_heads=2 * G, n_kv_groups=2, w=64)
    force_gates(layer, 2)
    torch.manual_seed(5)
    x = torch.randn(2, 33, CFG["dim"])
    p = layer.project(x)
    assert all(t.is_contiguous() for t in p)  # kernels get dense per-branch tensors
    ref = causal_attention(p.q, p.k_win, p.v_win).float()
    y = layer(x)
    assert torch.allclose(y, layer.o_proj(ref.reshape(2, 33, -1)), atol=1e-5)
    # and a window shorter than T is exactly a sliding window
    layer.w = 8
    ref8 = causal_attention(p.q, p.k_win, p.v_win, w=8).float()
    assert torch.allclose(layer(x), layer.o_proj(ref8.reshape(2, 33, -1)), atol=1e-5)


def test_full_coverage_selection_equals_causal_attention():
    layer = make_layer(n_sel=5, l_sel=8)  # 5 * 8 >= T = 37: every eligible block is selected
    force_gates(layer, 1)
    torch.manual_seed(6)
    x = torch.randn(1, 37, CFG["dim"])
    p = layer.project(x)
    ref = causal_attention(p.q, p.k_slc, p.v_slc).float()
    assert torch.allclose(layer(x), layer.o_proj(ref.reshape(1, 37, -1)), atol=1e-5)


def test_gradients_reach_every_parameter():
    layer = make_layer()
    torch.manual_seed(7)
    x = torch.randn(2, 40, CFG["dim"], requires_grad=True)
    layer(x).square().sum().backward()
    for name, prm in layer.named_parameters():
        assert prm.grad is not None and prm.grad.abs().sum() > 0, name
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("T", [1, 5, 8])
def test_bf16_finite_short_sequences(T):
    layer = make_layer().to(torch.bfloat16)
    x = torch.randn(2, T, CFG["dim"], dtype=torch.bfloat16)
    y, info = layer(x, return_branches=True)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert torch.isfinite(info["o_cmp"]).all()
    if T < CFG["l"]:  # no compressed token visible anywhere: the branch is exactly 0
        assert (info["o_cmp"] == 0).all()


def test_fp16_autocast_finite_short_sequence():
    layer = make_layer()
    x = torch.randn(2, 6, CFG["dim"])
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            y = layer(x)
    except RuntimeError as err:  # some CPU builds lack fp16 kernels
        pytest.skip(f"fp16 autocast unsupported on this CPU build: {err}")
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("field,value", [
    ("n_kv_groups", 3),   # n_heads=4 not a multiple
    ("d", 3),             # does not divide l=8
    ("l_sel", 6),         # d=4 does not divide l_sel
    ("l", 2),             # l < d
    ("d_k", 7),           # RoPE needs even d_k
    ("n_sel", 0),
    ("w", -1),
    ("dim", 0),
    ("compression", "max"),
    ("rope_base", 0.0),
])
def test_bad_constructor_args_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"\b{field}="):
        NSAAttention(**{**CFG, field: value})
