"""nsa_decode at absolute offsets equals nsa_attention over the full sequence."""
from __future__ import annotations

import pytest
import torch

from nsa.ops import nsa_attention, nsa_decode
from nsa.ops.tuning import tuning_for
from nsa.ops.testing import decode_views, make_inputs

L, D, L_SEL, N_SEL, W = 16, 8, 16, 3, 12
HP = dict(l=L, d=D, l_sel=L_SEL, n_sel=N_SEL, w=W)
T = L + 3 * D + 5 + 40  # crosses several compressed-token emission boundaries (t = 15, 23, 31, ...)


@pytest.fixture(scope="module")
def full():
    xs = make_inputs(2, T, 6, 2, 16, 8, l=L, d=D, seed=21, q_scale=2.0)
    o, idx = nsa_attention(*xs, **HP, backend="torch")
    return xs, o, idx


def test_single_token_decode_every_position(full):
    xs, o, idx = full
    for t in range(T):
        views, pos0, win_pos0 = decode_views(xs, t, 1, W, L, D)
        od, id_ = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP)
        assert od.shape == (2, 1, 6, 8) and id_.shape == (2, 1, 2, N_SEL)
        assert torch.equal(id_, idx[:, t: t + 1]), t
        assert (od - o[:, t: t + 1]).abs().max().item() <= 1e-5, t


@pytest.mark.parametrize("t,tq", [(0, 7), (13, 9), (30, 21), (T - 5, 5)])
def test_chunked_decode(full, t, tq):
    xs, o, idx = full
    views, pos0, win_pos0 = decode_views(xs, t, tq, W, L, D)
    od, id_ = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP)
    assert torch.equal(id_, idx[:, t: t + tq])
    assert (od - o[:, t: t + tq]).abs().max().item() <= 1e-5


def test_decode_with_whole_window_buffer_and_extra_cmp(full):
    """A window buffer from position 0 and compressed tokens beyond the visible ones are allowed."""
    xs, o, idx = full
    t = 40
    q, kc, vc, ks, vs, kw, vw, g = xs
    od, id_ = nsa_decode(q[:, t:t + 1], kc, vc, ks[:, :t + 1], vs[:, :t + 1], kw[:, :t + 1],
                         vw[:, :t + 1], g[:, t:t + 1], pos0=t, win_pos0=0, **HP)
    assert torch.equal(id_, idx[:, t:t + 1])
    assert (od - o[:, t:t + 1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("t", [3, L - 1, L + 2 * D - 1, L + 3 * D + 4])
def test_reference_decode_matches_reference_full(t):
    xs = make_inputs(1, L + 3 * D + 5, 4, 2, 8, 8, l=L, d=D, seed=3)
    o, idx = nsa_attention(*xs, **HP, backend="reference")
    views, pos0, win_pos0 = decode_views(xs, t, 1, W, L, D)
    od, id_ = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP, backend="reference")
    assert torch.equal(id_, idx[:, t:t + 1])
    assert (od - o[:, t:t + 1]).abs().max().item() <= 1e-6


def test_decode_bf16_matches_prefill_bf16():
    xs = make_inputs(1, 64, 4, 1, 16, 16, l=L, d=D, seed=8, dtype=torch.bfloat16)
    o, idx = nsa_attention(*xs, **HP, backend="torch")
    for t in (15, 31, 47, 63):
        views, pos0, win_pos0 = decode_views(xs, t, 1, W, L, D)
        od, id_ = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP)
        assert torch.equal(id_, idx[:, t:t + 1])
        assert (od.float() - o[:, t:t + 1].float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("field,kwargs,msg", [
    ("win_pos0", dict(win_pos0=1), "win_pos0"),
    ("pos0", dict(pos0=-1), "pos0"),
])
def test_decode_bad_offsets(full, field, kwargs, msg):
    xs, _, _ = full
    views, pos0, win_pos0 = decode_views(xs, 5, 1, W, L, D)
    args = dict(pos0=pos0, win_pos0=win_pos0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        nsa_decode(*views, **args, **HP)


def test_decode_too_few_compressed_tokens(full):
    xs, _, _ = full
    views, pos0, win_pos0 = decode_views(xs, 40, 1, W, L, D)
    views[1], views[2] = views[1][:, :2], views[2][:, :2]
    with pytest.raises(ValueError, match="k_cmp"):
        nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **HP)


def test_decode_long_cache_uses_token_gather_path():
    """S > the dense limit (TorchTuning.dense_factor * n_sel * l_sel) and few queries: per-token gather."""
    hp = dict(l=8, d=4, l_sel=8, n_sel=2, w=6)
    limit = int(tuning_for("cpu").torch.dense_factor * hp["n_sel"] * hp["l_sel"])
    T = limit + 40
    xs = make_inputs(2, T, 4, 2, 8, 8, l=8, d=4, seed=13, q_scale=2.0)
    o, idx = nsa_attention(*xs, **hp, backend="torch")
    for t, tq in ((limit + 5, 1), (limit + 22, 1), (T - 1, 1), (limit + 30, 3)):
        views, pos0, win_pos0 = decode_views(xs, t, tq, 6, 8, 4)
        od, id_ = nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **hp)
        assert torch.equal(id_, idx[:, t:t + tq])
        assert (od - o[:, t:t + tq]).abs().max().item() <= 1e-5
