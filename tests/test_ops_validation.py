"""Bad inputs to nsa_attention raise ValueError naming the field; backend dispatch and counters."""
from __future__ import annotations

import pytest
import torch

import nsa.ops.dispatch as dispatch
from nsa.ops import (KernelPolicy, fallback_counts, nsa_attention, reset_fallback_counts,
                     resolve_backend)
from nsa.ops.testing import make_inputs

HP = dict(l=8, d=4, l_sel=8, n_sel=3, w=6)
NAMES = ["q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"]


def _inputs():
    return make_inputs(1, 20, 4, 2, 8, 6, l=8, d=4)


def _call(xs, **kw):
    return nsa_attention(*xs, **{**HP, "backend": "torch", **kw})


@pytest.mark.parametrize("field,value,msg", [
    ("l", 6, "d=4 must divide l=6"), ("l", 2, "l=2 must be >= d=4"), ("d", 0, "d must be positive"),
    ("l_sel", 10, "d=4 must divide l_sel=10"), ("n_sel", 0, "n_sel must be positive"),
    ("w", -1, "w must be positive"), ("w", 2.0, "w must be a Python int"),
    ("scale", -1.0, "scale must be positive"), ("backend", "cuda", "backend must be one of"),
])
def test_bad_hyperparameters(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        _call(_inputs(), **{field: value})


def _mutate(xs, name, fn):
    xs = list(xs)
    k = NAMES.index(name)
    xs[k] = fn(xs[k])
    return xs


@pytest.mark.parametrize("name,fn,msg", [
    ("q", lambda x: x[0], "q must have rank 4"),
    ("gates", lambda x: x[..., :2], "gates must have shape"),
    ("k_slc", lambda x: x[:, :-1], "k_slc has 19 tokens but v_slc has 20"),
    ("v_slc", lambda x: x[:, :-1], "k_slc has 20 tokens but v_slc has 19"),
    ("k_win", lambda x: x[..., :4], "k_win has last dim 4"),
    ("v_cmp", lambda x: x[..., :4], "v_cmp has last dim 4"),
    ("k_cmp", lambda x: x[:, :-1], "k_cmp has 3 tokens but v_cmp has 4"),
    ("v_win", lambda x: x[:, :, :1], "v_win has 1 heads"),
    ("k_slc", lambda x: x.double(), "k_slc has dtype torch.float64 but q has torch.float32"),
    ("q", lambda x: x.int(), "q must be a floating tensor"),
    ("v_win", lambda x: torch.cat([x, x]), "v_win has batch 2"),
])
def test_bad_tensors(name, fn, msg):
    with pytest.raises(ValueError, match=msg):
        _call(_mutate(_inputs(), name, fn))


def test_heads_and_compressed_count():
    xs = _inputs()
    xs = _mutate(xs, "q", lambda x: torch.cat([x, x[:, :, :1]], 2))
    xs = _mutate(xs, "gates", lambda x: torch.cat([x, x[:, :, :1]], 2))
    with pytest.raises(ValueError, match="HQ=5 must be a multiple of the k/v heads H=2"):
        _call(xs)
    ys = _mutate(_mutate(_inputs(), "k_cmp", lambda x: x[:, :-1]), "v_cmp", lambda x: x[:, :-1])
    zs = _mutate(_mutate(_inputs(), "k_slc", lambda x: x[:, :-1]), "v_slc", lambda x: x[:, :-1])
    with pytest.raises(ValueError, match="k_slc/v_slc must hold q's T = 20 tokens, got 19"):
        _call(zs)
    with pytest.raises(ValueError, match=r"k_cmp/v_cmp must hold N = floor\(\(T - l\) / d\) \+ 1 = 4"):
        _call(ys)


def test_gates_may_be_fp32_with_bf16_qkv():
    xs = make_inputs(1, 20, 4, 2, 8, 6, l=8, d=4, dtype=torch.bfloat16)
    xs[-1] = xs[-1].float()
    o, _ = _call(xs)
    assert o.dtype == torch.bfloat16


def test_policy_on_cpu_and_fallback_counting():
    pol = KernelPolicy.resolve("cpu", torch.float32)
    assert pol.backend == "torch" and set(pol.backends) == {"cmp", "slc", "win", "scores"}
    line = str(pol)
    assert "\n" not in line and "requested=auto" in line and "cpu" in line
    assert resolve_backend("reference", "cpu", torch.float32) == "reference"
    assert resolve_backend("triton", "cpu", torch.float32) == "torch"
    reset_fallback_counts()
    xs = _inputs()
    _call(xs)  # auto on CPU: torch is the plan, not a fallback
    assert fallback_counts() == {}
    o_tr, i_tr = _call(xs, backend="triton")
    o_t, i_t = _call(xs)
    assert fallback_counts() == {"triton->torch": 1}
    assert torch.equal(o_tr, o_t) and torch.equal(i_tr, i_t)
    o_p, _ = _call(xs, backend=KernelPolicy.resolve("cpu", torch.float32, "torch"))
    assert torch.equal(o_p, o_t)


def test_triton_policy_names_each_branch_choice(monkeypatch):
    """With triton usable, the policy line says how the compressed and the window branch run and why
    (measured alternatives, flash-attn availability), and the other branches keep the plain reason."""
    monkeypatch.setattr(dispatch, "_triton_status", lambda dev: (True, "triton kernels available"))
    pol = KernelPolicy.resolve("cuda", torch.bfloat16)
    assert pol.backend == "triton"
    assert "compressed branch" in pol.reasons["cmp"] and "compressed branch" not in pol.reasons["win"]
    assert "FlexAttention" in pol.reasons["win"] and "flash-attn" in pol.reasons["win"]
    assert pol.reasons["slc"] == "triton kernels available"
    assert "FlexAttention" in str(pol)
    assert f"tuning={pol.tuning.name}" in str(pol) and pol.tuning.cmp_dense.mode == "auto"


def test_triton_unsupported_shape_falls_back(monkeypatch):
    """A triton hook raising NotImplementedError falls back to torch and is counted."""
    class FakeTriton:
        @staticmethod
        def triton_available():
            return True

        @staticmethod
        def nsa_attention_triton(*args, **kwargs):
            raise NotImplementedError("d_k=192 not supported")

    monkeypatch.setattr(dispatch, "triton_module", lambda: FakeTriton)
    import nsa.ops as ops
    monkeypatch.setattr(ops, "triton_module", lambda: FakeTriton)
    pol = KernelPolicy("triton", "cuda", "float32", {b: "triton" for b in dispatch.BRANCHES},
                       {b: "test" for b in dispatch.BRANCHES})
    reset_fallback_counts()
    xs = _inputs()
    o, idx = _call(xs, backend=pol)
    assert fallback_counts() == {"triton_unsupported->torch": 1}
    assert torch.equal(o, _call(xs)[0])
