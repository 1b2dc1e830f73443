"""The NSA op as the custom op nsa::attention (nsa/ops/custom_op.py): opcheck, the same numbers and
gradients as the eager op, and a whole TinyLM under torch.compile(fullgraph=True) (a graph break
fails the compile) with the eager model's loss and gradients."""
from __future__ import annotations

import copy

import pytest
import torch

import nsa.ops as nsa_ops
from nsa import TinyLM
from nsa.ops.custom_op import attention_op
from nsa.ops.dispatch import cached_policy

HP = dict(l=8, d=4, l_sel=8, n_sel=2, w=8)
TINY = dict(vocab=64, dim=32, n_layers=2, n_heads=4, n_kv_groups=2, d_k=8, d_v=8, l=8, d=4, l_sel=8,
            n_sel=2, w=16, backend="torch")


def _inputs(T: int, dtype=torch.float64, seed: int = 0, B: int = 1, HQ: int = 4, H: int = 2, dk: int = 8):
    """The op's eight inputs (leaves requiring grad): q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates."""
    g = torch.Generator().manual_seed(seed)
    N = 0 if T < HP["l"] else (T - HP["l"]) // HP["d"] + 1

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()
    gates = torch.rand(B, T, HQ, 3, generator=g, dtype=dtype).requires_grad_()
    return [r(B, T, HQ, dk), r(B, N, H, dk), r(B, N, H, dk), r(B, T, H, dk), r(B, T, H, dk), r(B, T, H, dk),
            r(B, T, H, dk), gates]


def _schema_args(xs, backend: str = "torch", tile=None):
    return (*xs, *HP.values(), xs[0].shape[-1] ** -0.5, backend, tile, None, True, "preset")


def test_opcheck():
    """Schema, fake (meta) implementation against the real one, autograd registration, and the op
    under AOT dispatch with dynamic shapes (torch.library.opcheck's standard tests)."""
    result = torch.library.opcheck(attention_op, _schema_args(_inputs(20)))
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("T,tile,backend", [(20, None, "torch"), (40, 16, "torch"), (6, None, "torch"),
                                            (12, None, "reference")])
def test_custom_op_matches_eager_op_bitwise(T, tile, backend):
    """Output, block indices and every input's gradient equal the eager op's bit for bit (one tile,
    several recomputed tiles, T < l with no compressed token, the fp64 reference)."""
    xs = _inputs(T)
    o, idx = nsa_ops.nsa_attention(*xs, **HP, backend=backend, tile=tile)
    do = torch.randn_like(o)
    want = torch.autograd.grad(o, xs, do, allow_unused=True)
    ys = [x.detach().clone().requires_grad_() for x in xs]
    o2, idx2 = attention_op(*_schema_args(ys, backend, tile))
    assert torch.equal(o2, o) and torch.equal(idx2, idx) and o2.dtype == o.dtype
    got = torch.autograd.grad(o2, ys, do)
    for name, g, w in zip(("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates"), got, want):
        assert torch.equal(g, torch.zeros_like(g) if w is None else w), name


def test_eager_call_skips_the_custom_op(monkeypatch):
    """Outside a trace nsa_attention never enters the custom-op path (no dispatch overhead)."""
    def boom(*a, **k):
        raise AssertionError("eager call routed through the custom op")
    monkeypatch.setattr(nsa_ops, "traced_attention", boom)
    o, _ = nsa_ops.nsa_attention(*_inputs(20), **HP, backend="torch")
    assert o.shape == (1, 20, 4, 8)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("grad_checkpointing", [False, True])
def test_tinylm_compiles_fullgraph_with_eager_loss_and_grads(grad_checkpointing):
    """torch.compile(TinyLM, fullgraph=True): any graph break raises; the dynamo graph holds the op as
    nsa::attention (not the torch backend inlined) and the backward graph nsa::attention_backward;
    loss and gradients match the eager model's (T=40 spans several compressed and selection blocks)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    torch.manual_seed(0)
    m0 = TinyLM(**TINY, grad_checkpointing=grad_checkpointing)
    m1 = copy.deepcopy(m0)
    targets: list = []
    seen_bwd: list = []

    def record(gm, _example):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    def record_bwd(gm, _example):
        seen_bwd.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)
    compiled = torch.compile(m1, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record_bwd))
    ids = torch.randint(0, TINY["vocab"], (2, 41), generator=torch.Generator().manual_seed(1))
    loss0, g0 = _loss_and_grads(m0, ids)
    for _ in range(2):   # the second step reuses the compiled graph
        loss1, g1 = _loss_and_grads(compiled, ids)
    assert targets.count(torch.ops.nsa.attention.default) == TINY["n_layers"]
    # checkpointing recomputes the op's forward in backward, as in the eager model
    assert seen_bwd.count(torch.ops.nsa.attention.default) == TINY["n_layers"] * grad_checkpointing
    assert seen_bwd.count(torch.ops.nsa.attention_backward.default) == TINY["n_layers"]
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tinylm_compiles_fullgraph_on_triton_with_eager_loss_and_grads():
    """On CUDA the op resolves to the Triton kernels (their autograd.Function runs inside the custom
    op's kernels): the compiled whole model gives the eager model's loss and gradients."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    cfg = dict(TINY, dim=64, d_k=32, d_v=32, l=16, d=8, l_sel=32, n_sel=4, w=64, backend="triton")
    m0 = TinyLM(**cfg).cuda()
    m1 = copy.deepcopy(m0)
    compiled = torch.compile(m1, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, cfg["vocab"], (2, 301), generator=torch.Generator().manual_seed(1)).cuda()
    loss0, g0 = _loss_and_grads(m0, ids)
    loss1, g1 = _loss_and_grads(compiled, ids)
    assert cached_policy("triton", ids.device, torch.float32).backend == "triton"
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=1e-6)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
