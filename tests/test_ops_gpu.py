"""The torch backend (and the dispatch) on CUDA; skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from nsa.ops import KernelPolicy, nsa_attention, nsa_decode, nsa_reference
from nsa.ops.testing import (INPUT_NAMES, clone_inputs, decode_views, grads, lowp_attention_error,
                             make_inputs, rel_rms)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
HP = dict(l=16, d=8, l_sel=16, n_sel=4, w=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [None, 32])
def test_cuda_torch_backend_matches_reference(dtype, tile):
    xs = make_inputs(2, 203, 6, 2, 32, 16, l=16, d=8, dtype=dtype, seed=1)
    xr = clone_inputs(xs, torch.float64)
    o_r, i_r = nsa_reference(*xr, **HP)
    go = torch.randn(o_r.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    o_r.backward(go)
    xt = [x.detach().cuda().requires_grad_() for x in xs]
    o_t, i_t = nsa_attention(*xt, **HP, backend="torch", tile=tile)
    o_t.backward(go.to("cuda", dtype))
    tol_o, tol_g = (1e-5, 1e-5) if dtype == torch.float32 else lowp_attention_error(dtype)
    assert torch.equal(i_t.cpu(), i_r)
    assert rel_rms(o_t.cpu(), o_r) <= 1.5 * tol_o
    for nm, a, b in zip(INPUT_NAMES, grads(xt), grads(xr)):
        assert rel_rms(a.cpu(), b) <= 1.5 * tol_g, nm


def test_cuda_decode_matches_prefill():
    xs = make_inputs(2, 150, 4, 2, 16, 16, l=16, d=8, seed=3, device="cuda")
    o, idx = nsa_attention(*xs, **HP, backend="torch")
    for t in (0, 15, 16, 70, 149):
        views, pos0, win_pos0 = decode_views(xs, t, 1, HP["w"], HP["l"], HP["d"])
        od, id_ = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="torch")
        assert torch.equal(id_, idx[:, t:t + 1])
        assert (od - o[:, t:t + 1]).abs().max().item() <= 1e-5


def test_cuda_auto_policy_and_cross_backend_selection():
    pol = KernelPolicy.resolve("cuda", torch.bfloat16)
    assert pol.backend in ("triton", "torch") and "cuda" in str(pol)
    xs = make_inputs(1, 300, 4, 2, 32, 32, l=16, d=8, seed=4, dtype=torch.bfloat16, device="cuda")
    o_a, i_a = nsa_attention(*xs, **HP, backend="auto")
    o_t, i_t = nsa_attention(*xs, **HP, backend="torch")
    assert torch.equal(i_a, i_t)
    assert rel_rms(o_a, o_t) <= 2e-2
