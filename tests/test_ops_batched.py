"""The tiled torch backend against the fp64 reference: outputs, every gradient, selected blocks."""
from __future__ import annotations

import functools

import pytest
import torch

from nsa.ops import nsa_attention, nsa_reference
from nsa.ops.batched import nsa_torch
from nsa.ops.common import NSAParams
from nsa.ops.testing import (INPUT_NAMES, clone_inputs, grads, lowp_attention_error, make_inputs,
                             rel_rms)

# (B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, tile, dense_factor): awkward shapes, both
# selected-block paths (dense_factor 0 -> per-query gather, large -> block-masked dense)
CASES = {
    "T1_G3": (1, 1, 3, 1, 16, 8, 8, 4, 8, 2, 4, 64, 4.0),
    "T_lt_l": (2, 13, 4, 2, 16, 16, 16, 8, 16, 3, 5, 8, 4.0),
    "ragged_gather": (2, 150, 4, 2, 16, 8, 8, 4, 16, 3, 20, 32, 0.0),
    "ragged_dense": (1, 150, 4, 2, 16, 8, 8, 4, 16, 3, 20, 32, 100.0),
    "ragged_mixed": (1, 131, 6, 2, 8, 12, 16, 8, 16, 4, 9, 16, 1.0),
    "G1": (1, 77, 2, 2, 16, 16, 8, 8, 8, 4, 11, 32, 2.0),
    "G16": (1, 70, 16, 1, 16, 8, 8, 4, 16, 2, 30, 32, 0.0),
    "dk64_dv128": (1, 40, 2, 1, 64, 128, 8, 4, 8, 3, 7, 16, 0.0),
    "dk192_dv128": (1, 24, 2, 1, 192, 128, 8, 4, 8, 2, 6, 16, 2.0),
}


def _run_pair(case, dtype=torch.float32, seed=0, q_scale=1.0):
    B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, tile, df = case
    xs = make_inputs(B, T, HQ, H, dk, dv, l=l, d=d, dtype=dtype, seed=seed, q_scale=q_scale)
    hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    xr = clone_inputs(xs, torch.float64)  # the reference sees the same (rounded) inputs in fp64
    xt = clone_inputs(xs)
    o_r, i_r = nsa_reference(*xr, **hp)
    o_t, i_t = nsa_torch(*xt, p=NSAParams(**hp), scale=dk ** -0.5, tile=tile, dense_factor=df)
    go = torch.randn(o_r.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    o_r.backward(go)
    o_t.backward(go.to(dtype))
    return (o_r, i_r, grads(xr)), (o_t, i_t, grads(xt))


@pytest.mark.parametrize("name", list(CASES))
def test_torch_matches_reference_fp32(name):
    (o_r, i_r, g_r), (o_t, i_t, g_t) = _run_pair(CASES[name])
    assert o_t.dtype == torch.float32
    assert torch.equal(i_t, i_r)
    assert rel_rms(o_t, o_r) <= 1e-5
    for nm, a, b in zip(INPUT_NAMES, g_t, g_r):
        assert a.shape == b.shape, nm
        assert rel_rms(a, b) <= 1e-5, nm


@functools.lru_cache(maxsize=None)
def _noise_floor(dtype: torch.dtype) -> tuple[float, float]:
    return lowp_attention_error(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["ragged_gather", "ragged_dense", "G16"])
def test_torch_matches_reference_low_precision(name, dtype):
    """Error vs fp64 bounded by a small multiple of what eager torch attention makes in dtype."""
    out_floor, grad_floor = _noise_floor(dtype)
    (o_r, i_r, g_r), (o_t, i_t, g_t) = _run_pair(CASES[name], dtype=dtype)
    assert o_t.dtype == dtype
    assert torch.equal(i_t, i_r)  # selection scores run in fp32 on the same inputs
    assert rel_rms(o_t, o_r) <= 1.5 * out_floor
    for nm, a, b in zip(INPUT_NAMES, g_t, g_r):
        assert torch.isfinite(a).all(), nm
        assert rel_rms(a, b) <= 1.5 * grad_floor, nm


def _perturb_after(xs, t0: int, l: int, d: int, seed: int = 11):
    """Copies of xs where every token after t0 (and every compressed block ending after t0) changes."""
    gen = torch.Generator().manual_seed(seed)
    out = [x.clone() for x in xs]
    n_keep = max(0, (t0 + 1 - l) // d + 1) if t0 + 1 >= l else 0
    for k, x in enumerate(out):
        cut = n_keep if k in (1, 2) else t0 + 1
        x[:, cut:] = torch.randn(x[:, cut:].shape, generator=gen).to(x.dtype) * 3
    out[-1] = out[-1].clamp(0, 1)
    return out


@pytest.mark.parametrize("backend,df", [("reference", None), ("torch", 0.0), ("torch", 100.0)])
def test_causality_by_perturbation(backend, df):
    B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w = 1, 90, 4, 2, 8, 8, 8, 4, 8, 3, 12
    xs = make_inputs(B, T, HQ, H, dk, dv, l=l, d=d, seed=5)
    hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    for t0 in (37, 64):
        ys = _perturb_after(xs, t0, l, d)
        if backend == "reference":
            (oa, ia), (ob, ib) = nsa_reference(*xs, **hp), nsa_reference(*ys, **hp)
        else:
            run = functools.partial(nsa_torch, p=NSAParams(**hp), scale=dk ** -0.5, tile=16,
                                    dense_factor=df)
            (oa, ia), (ob, ib) = run(*xs), run(*ys)
        assert (oa[:, : t0 + 1] - ob[:, : t0 + 1]).abs().max().item() <= 1e-6
        assert torch.equal(ia[:, : t0 + 1], ib[:, : t0 + 1])
        assert (oa[:, t0 + 1:] - ob[:, t0 + 1:]).abs().max().item() > 1e-3  # perturbation is seen


def test_selection_invariants():
    B, T, HQ, H, dk, l, d, l_sel, n_sel = 2, 300, 8, 2, 16, 8, 4, 16, 5
    xs = make_inputs(B, T, HQ, H, dk, dk, l=l, d=d, seed=9, q_scale=3.0)
    o, idx = nsa_attention(*xs, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=16, backend="torch")
    assert idx.shape == (B, T, H, n_sel) and idx.dtype == torch.int64
    t = torch.arange(T).view(1, T, 1, 1)
    cur = t // l_sel
    valid = idx >= 0
    # count: every eligible block while fewer than n_sel exist; -1 padding comes last
    assert torch.equal(valid.sum(-1), torch.clamp(cur[..., 0] + 1, max=n_sel).expand(B, T, H))
    assert torch.equal(valid, valid.int().sort(dim=-1, descending=True, stable=True).values.bool())
    # no block starting after t; ascending and unique among valid slots
    assert ((idx * l_sel <= t) | ~valid).all()
    v = torch.where(valid, idx, 10 ** 6)
    assert ((v[..., 1:] > v[..., :-1]) | (v[..., 1:] == 10 ** 6)).all()
    # forced blocks present: the block of t, block 0 and the block before (n_sel >= 3 here)
    has = lambda j: ((idx == j) | (j < 0)).any(-1)  # noqa: E731
    assert has(cur).all() and has(torch.zeros_like(cur)).all() and has(cur - 1).all()


def test_selection_attention_uses_block_idx_for_every_head_of_group():
    """With gates (0, 1, 0), each query head attends exactly over its group's selected tokens."""
    B, T, HQ, H, dk, l, d, l_sel, n_sel = 1, 70, 6, 2, 8, 8, 4, 8, 3
    xs = make_inputs(B, T, HQ, H, dk, dk, l=l, d=d, seed=4, q_scale=2.0)
    xs[-1] = torch.zeros_like(xs[-1])
    xs[-1][..., 1] = 1.0
    o, idx = nsa_attention(*xs, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=4, backend="torch")
    q, ks, vs = xs[0].double(), xs[3].double(), xs[4].double()
    G = HQ // H
    for t in (5, 33, 69):
        for hq in range(HQ):
            h = hq // G
            blocks = [j for j in idx[0, t, h].tolist() if j >= 0]
            toks = [s for j in blocks for s in range(j * l_sel, (j + 1) * l_sel) if s <= t]
            p = (ks[0, toks, h] @ q[0, t, hq] * dk ** -0.5).softmax(0)
            assert torch.allclose(o[0, t, hq].double(), p @ vs[0, toks, h], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_exact_ties_go_to_lower_index_in_every_dtype(dtype):
    """Identical compressed keys -> uniform p_cmp -> interior selection blocks tie exactly."""
    B, T, HQ, H, dk, l, d, l_sel, n_sel = 1, 200, 4, 2, 8, 8, 4, 8, 5
    xs = make_inputs(B, T, HQ, H, dk, dk, l=l, d=d, seed=2, dtype=dtype)
    xs[1] = xs[1][:, :1].expand_as(xs[1]).contiguous()  # every compressed key identical
    o, idx = nsa_attention(*xs, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=8, backend="torch")
    # block 0 scores 3/N (partly covered), interior blocks 4/N: forced + lowest interior indices
    for t in range(4 * l_sel, T):
        cur = t // l_sel  # >= 4, so blocks 1 and 2 are not forced and win the tie
        assert idx[0, t, 0].tolist() == sorted({0, 1, 2, cur - 1, cur}), t
    assert torch.equal(idx[..., 0, :], idx[..., 1, :])
    _, i_ref = nsa_reference(*xs, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=8)
    assert torch.equal(idx, i_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 31])
def test_no_nan_low_precision_short_and_empty_branches(dtype, T):
    l, d = 32, 16  # T < l: the compressed branch is empty (k_cmp has 0 tokens)
    xs = make_inputs(2, T, 4, 2, 16, 16, l=l, d=d, dtype=dtype, seed=T, q_scale=4.0,
                     requires_grad=True)
    o, idx = nsa_attention(*xs, l=l, d=d, l_sel=64, n_sel=4, w=512, backend="torch")
    assert torch.isfinite(o).all()
    o.float().square().sum().backward()
    for nm, g in zip(INPUT_NAMES, grads(xs)):
        assert torch.isfinite(g).all(), nm
    assert (idx[..., 0] == 0).all() and (idx[..., 1:] == -1).all()


def test_tiles_and_checkpointing_do_not_change_results():
    xs = make_inputs(1, 100, 4, 2, 8, 8, l=8, d=4, seed=6)
    p = NSAParams(8, 4, 8, 3, 10)
    outs = []
    for tile, ckpt in ((7, True), (100, False), (32, False)):
        ys = clone_inputs(xs)
        o, idx = nsa_torch(*ys, p=p, scale=8 ** -0.5, tile=tile, checkpoint=ckpt)
        o.square().sum().backward()
        outs.append((o, idx, grads(ys)))
    for o, idx, gs in outs[1:]:
        assert torch.equal(idx, outs[0][1])
        assert rel_rms(o, outs[0][0]) <= 1e-6
        assert all(rel_rms(a, b) <= 1e-6 for a, b in zip(gs, outs[0][2]))


def test_non_contiguous_inputs():
    """Views with odd strides (as a layer's split/unbind produces) give the contiguous result."""
    xs = make_inputs(2, 64, 4, 2, 8, 8, l=8, d=4, seed=12)
    p = NSAParams(8, 4, 8, 2, 10)
    ref = nsa_torch(*xs, p=p, scale=8 ** -0.5, tile=16, dense_factor=0.0)
    # batch-minor storage: every input is a non-contiguous [B, T, H, D] view
    odd = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in xs]
    assert not any(x.is_contiguous() for x in odd)
    out = nsa_torch(*odd, p=p, scale=8 ** -0.5, tile=16, dense_factor=0.0)
    assert torch.equal(out[1], ref[1])
    assert (out[0] - ref[0]).abs().max().item() <= 1e-6
