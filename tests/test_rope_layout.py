"""The fused RoPE + branch-major layout kernel of NSAAttention.project (nsa/ops/triton/rope_layout.py)
against the layer's torch path (apply_rope and the permute copies): the same bits forward and backward;
also BlockCompressor's copy-free flatten (add_pos). On CUDA where present, else on CPU through Triton's
interpreter (TRITON_INTERPRET=1, tests/conftest.py); the gpu test adds production head shapes."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from nsa.layers.attention import NSAAttention  # noqa: E402
import nsa.layers.compression as compression  # noqa: E402
import nsa.layers.rope as rope  # noqa: E402
from nsa.layers.rope import apply_rope, rope_table, shared_rope_table  # noqa: E402
from nsa.ops.triton.rope_layout import rope_layout  # noqa: E402

GEOM = dict(l=4, d=2, l_sel=4, n_sel=2, w=4)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
OP = "auto" if DEV == "cuda" else "torch"   # the op's deterministic choice at these sizes either way


def make_layer(dk=8, dv=6, hq=4, h=2, dtype=torch.float32, device=DEV, **over):
    torch.manual_seed(0)
    kw = dict(dim=16, n_heads=hq, n_kv_groups=h, d_k=dk, d_v=dv, backend=OP, **GEOM)
    return NSAAttention(**{**kw, **over}).to(device=device, dtype=dtype)


def run_project(layer, mode, x, **kw):
    """project under project_kernel=mode with a fixed random loss on every output: (outputs, dx, dW_qkv)."""
    layer.project_kernel = mode
    layer.zero_grad()
    x = x.detach().clone().requires_grad_()
    p = layer.project(x, **kw)
    g = torch.Generator(device=x.device).manual_seed(1)
    sum((t.float() * torch.randn(t.shape, generator=g, device=x.device)).sum() for t in p).backward()
    return p, x.grad, layer.qkv_proj.weight.grad.clone()


def assert_same(a, b):
    (pa, dxa, dwa), (pb, dxb, dwb) = a, b
    for name, u, w in zip(pa._fields, pa, pb):
        assert u.dtype == w.dtype and u.stride() == w.stride(), name   # the same layout, not only values
        assert torch.equal(u, w), name
    assert torch.equal(dxa, dxb) and torch.equal(dwa, dwb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dk,dv", [(8, 6), (6, 8)])   # a non-power-of-two half (3) and value width (6)
def test_fused_project_matches_torch_path_bit_for_bit(dtype, dk, dv):
    layer = make_layer(dk, dv, dtype=dtype)
    x = torch.randn(2, 5, 16, dtype=dtype, device=DEV)
    assert_same(run_project(layer, "torch", x, offset=3), run_project(layer, "triton", x, offset=3))


def test_fused_project_several_row_blocks():
    """B*T = 150 rows: three programs of 64 rows per head (block_rows), the last one partial."""
    layer = make_layer(4, 2, hq=2, h=1, dtype=torch.bfloat16)
    x = torch.randn(2, 75, 16, dtype=torch.bfloat16, device=DEV)
    assert_same(run_project(layer, "torch", x, offset=1), run_project(layer, "triton", x, offset=1))


def test_fused_project_device_positions_and_long_offsets():
    layer = make_layer(hq=2, h=1, dtype=torch.bfloat16)
    x = torch.randn(1, 3, 16, dtype=torch.bfloat16, device=DEV)
    pos = torch.tensor([70000, 5, 123456], device=DEV)   # angles far from 0: the fp32 tables must be apply_rope's
    assert_same(run_project(layer, "torch", x, positions=pos), run_project(layer, "triton", x, positions=pos))
    assert_same(run_project(layer, "torch", x, offset=65531), run_project(layer, "triton", x, offset=65531))


def test_rope_layout_outputs_and_partial_gradients():
    """The function alone: q/k/v equal apply_rope + the permute copies; a loss on q alone gives dy zero in
    the k and v columns (every column of dy is written, none left uninitialised)."""
    hq, h, dk, dv, B, T = 3, 2, 4, 2, 2, 3
    y = torch.randn(B, T, (hq + 3 * h) * dk + 3 * h * dv, device=DEV, requires_grad=True)
    cos, sin = rope_table(T, dk, 500.0, offset=2, device=DEV)
    q, *kv = rope_layout(y, cos, sin, hq, h, dk, dv)
    yq, yk, yv = y.detach().split((hq * dk, 3 * h * dk, 3 * h * dv), dim=-1)
    assert torch.equal(q, apply_rope(yq.reshape(B, T, hq, dk), offset=2, base=500.0))
    k_ref = apply_rope(yk.reshape(B, T, 3, h, dk).permute(2, 0, 1, 3, 4).reshape(3 * B, T, h, dk), 2, 500.0)
    assert torch.equal(torch.stack(kv[:3]), k_ref.view(3, B, T, h, dk))
    assert torch.equal(torch.stack(kv[3:]), yv.reshape(B, T, 3, h, dv).permute(2, 0, 1, 3, 4))
    for t in kv:   # planes of branch-major buffers: each branch contiguous, one buffer per k and v
        assert t.is_contiguous() and t.untyped_storage().data_ptr() in (kv[0].data_ptr(), kv[3].data_ptr())
    (dy,) = torch.autograd.grad(q.sum(), y)
    assert torch.equal(dy[..., hq * dk:], torch.zeros_like(dy[..., hq * dk:]))
    y_t = y.detach().clone().requires_grad_()
    apply_rope(y_t[..., :hq * dk].reshape(B, T, hq, dk), offset=2, base=500.0).sum().backward()
    assert torch.equal(dy, y_t.grad)


def test_layer_forward_backward_and_decode_same_with_fused_project():
    """The whole layer computes the same y and parameter gradients on either project path, and decode at
    an offset (positions cache.length ..) as well."""
    layer = make_layer(dtype=torch.float32)
    x = torch.randn(1, 12, 16, device=DEV)
    res = {}
    for mode in ("torch", "triton"):
        layer.project_kernel = mode
        layer.zero_grad()
        y = layer(x)
        y.square().sum().backward()
        cache = layer.new_cache()
        with torch.no_grad():
            layer.prefill(x[:, :9], cache)
            y_dec = layer.decode(x[:, 9:], cache)
        res[mode] = (y, {n: p.grad.clone() for n, p in layer.named_parameters()}, y_dec)
    (ya, ga, da), (yb, gb, db) = res["torch"], res["triton"]
    assert torch.equal(ya, yb) and torch.equal(da, db)
    assert ga.keys() == gb.keys() and all(torch.equal(ga[n], gb[n]) for n in ga)


def test_project_kernel_choice_and_errors(monkeypatch):
    layer = make_layer()
    y = torch.zeros(1, 2, sum(layer._split), device=DEV)
    assert layer._fused_project(y) == (DEV == "cuda")      # auto: the kernel on CUDA, torch on CPU
    assert not layer._fused_project(y.double())            # fp64 stays on torch
    layer.project_kernel = "triton"
    assert layer._fused_project(y)                          # forced (on CPU through the interpreter)
    with pytest.raises(ValueError, match="positions"):
        layer.project(torch.zeros(1, 2, 16, device=DEV), positions=torch.arange(3, device=DEV))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="project_kernel='triton' needs"):
        layer._fused_project(y.cpu())
    layer.project_kernel = "fast"
    with pytest.raises(ValueError, match="project_kernel='fast'"):
        layer._fused_project(y)


def test_rope_layout_bad_inputs_name_the_field():
    cos, sin = rope_table(2, 4)
    with pytest.raises(ValueError, match="^y: expected"):
        rope_layout(torch.zeros(1, 2, 7), cos, sin, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="^y has dtype"):
        rope_layout(torch.zeros(1, 2, 28, dtype=torch.float64), cos, sin, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="^sin: expected"):
        rope_layout(torch.zeros(1, 2, 28), cos, sin[:1], 1, 1, 4, 4)


def test_shared_rope_table_rows_growth_and_retired_tables_kept(monkeypatch):
    """Rows offset .. offset+T-1 of one table per (device, head_dim, base), grown by doubling; outgrown
    tables stay referenced (a captured CUDA graph may read them). Values: rope_table's (bit for bit on a
    GPU, test below; here within cos/sin's rounding, as a CPU's vector loop and scalar tail differ)."""
    monkeypatch.setattr(rope, "_TABLES", {})
    monkeypatch.setattr(rope, "_RETIRED", [])
    monkeypatch.setattr(rope, "MIN_TABLE", 8)
    dev = torch.device("cpu")
    cos, sin = shared_rope_table(5, 6, 100.0, 2, dev)
    ref = rope_table(5, 6, 100.0, offset=2)
    torch.testing.assert_close((cos, sin), ref, rtol=0, atol=1e-6)
    first = rope._TABLES[(dev, 6, 100.0)]
    assert first[0].shape == (8, 3) and cos.data_ptr() == first[0][2:].data_ptr()
    cos2, _ = shared_rope_table(7, 6, 100.0, 10, dev)            # needs 17 rows: grows to 32
    assert rope._TABLES[(dev, 6, 100.0)][0].shape == (32, 3) and rope._RETIRED == [first]
    torch.testing.assert_close(cos2, rope_table(7, 6, 100.0, offset=10)[0], rtol=0, atol=1e-6)
    shared_rope_table(3, 8, 100.0, 0, dev)                       # another head_dim: its own table
    assert len(rope._TABLES) == 2 and len(rope._RETIRED) == 1


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_contiguous_pos_add_same_bits(kind, dtype, monkeypatch):
    """BlockCompressor's blocks + pos_emb written contiguous (its flatten a view, add_pos) gives the plain
    add's compressed tokens and gradients (raw tokens, pos_emb, weights) bit for bit; decode's one block too."""
    def run():
        torch.manual_seed(0)
        phi = compression.BlockCompressor(8, 8, 4, kind).to(dtype)
        with torch.no_grad():
            phi.pos_emb.normal_()
        x = torch.randn(3, 2, 41, 3, 8, dtype=dtype)[1].requires_grad_()   # a branch plane, as project gives
        y = phi(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
        one = phi.compress_block(x.detach()[:, 8:16])
        return y, x.grad, {n: p.grad for n, p in phi.named_parameters()}, one

    y, dx, dp, one = run()
    blocks = compression.unfold_blocks(torch.zeros(1, 12, 2, 4), 8, 4)
    assert compression.add_pos(blocks, torch.ones(8, 4)).is_contiguous()
    monkeypatch.setattr(compression, "add_pos", lambda b, p: b + p)        # the plain add (and a copying flatten)
    y0, dx0, dp0, one0 = run()
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(one, one0)
    assert dp.keys() == dp0.keys() and all(torch.equal(dp[n], dp0[n]) for n in dp)


_PTX_PROBE = """
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nsa.ops.triton import rope_layout as R
out = {}
for bwd in (False, True):
    sig = {n: "*bf16" for n in ("Y", "Q", "K0", "K1", "K2", "V0", "V1", "V2")}
    sig.update(COS="*fp32", SIN="*fp32", n_rows="i32", T="i32")
    consts = dict(HQ=12, H=2, DK=64, DV=64, HALF_P=32, DV_P=64, BLOCK=R.block_rows(64, 64), BWD=bwd, INTERP=False)
    sig.update({k: "constexpr" for k in consts})
    k = triton.compile(ASTSource(fn=R._rope_layout, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, enable_fp_fusion=False))
    ptx = k.asm["ptx"]
    out[str(bwd)] = [len(re.findall(p, ptx)) for p in (r"\\bfma\\.", r"mul\\.rn\\.f32", r"cvt\\.rn\\.bf16\\.f32")]
print(json.dumps(out))
"""


def test_compiled_kernel_rounds_every_product_like_torch():
    """The bits above hold on a GPU only if the compiled kernel does what the interpreter does: compiled for
    sm90 (no device needed; a process without TRITON_INTERPRET), forward and backward have no FMA (every
    product rounded, enable_fp_fusion=False) and round to bf16 to nearest even (cvt.rn). This compile also
    catches what the interpreter lets through (e.g. if/else branches binding one name to two shapes)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _PTX_PROBE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    for bwd, (fma, mul_rn, cvt_rn) in json.loads(res.stdout.strip().splitlines()[-1]).items():
        assert fma == 0 and mul_rn > 0 and cvt_rn > 0, (bwd, fma, mul_rn, cvt_rn)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_fused_project_matches_torch_path(dtype):
    """On CUDA "auto" takes the native kernel; outputs, layouts and gradients are the torch path's bits
    (production-like heads: HQ=12, H=2, d_k=d_v=64; a partial last row block)."""
    layer = make_layer(64, 64, hq=12, h=2, dtype=dtype, device="cuda", dim=256)
    x = torch.randn(2, 1000, 256, device="cuda", dtype=dtype)
    layer.project_kernel = "auto"
    assert layer._fused_project(layer.qkv_proj(x))
    pos = torch.arange(1000, device="cuda") * 37
    dev = torch.device("cuda", torch.cuda.current_device())
    for off in (0, 3, 40000):   # the shared table's rows are the per-call table's bits
        got, ref = shared_rope_table(1000, 64, layer.rope_base, off, dev), rope_table(1000, 64, layer.rope_base, off,
                                                                                     device=dev)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    for kw in (dict(offset=0), dict(offset=40000), dict(positions=pos)):
        assert_same(run_project(layer, "torch", x, **kw), run_project(layer, "auto", x, **kw))
