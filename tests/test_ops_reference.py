"""The fp64 reference against hand-computed values and against plain causal attention."""
from __future__ import annotations

import pytest
import torch

from nsa.ops import causal_attention, nsa_attention, nsa_reference
from nsa.ops.common import NSAParams, overlap_matrix
from nsa.ops.reference import reference_block_scores, reference_select_one
from nsa.ops.testing import make_inputs

TINY = dict(l=4, d=2, l_sel=4, n_sel=2, w=3)


def _tiny_inputs(T: int = 10) -> list[torch.Tensor]:
    """One head, q = 0 (uniform attention everywhere), distinct values."""
    xs = make_inputs(1, T, 1, 1, 2, 2, l=4, d=2, dtype=torch.float64, seed=3)
    xs[0] = torch.zeros_like(xs[0])
    return xs


def test_overlap_matrix_geometry():
    # l=4, d=2: compression block i covers [2i, 2i+4); l_sel=4: selection block j covers [4j, 4j+4)
    M = overlap_matrix(4, 3, 4, 2, 4)
    want = torch.tensor([[4, 0, 0], [2, 2, 0], [0, 4, 0], [0, 2, 2]], dtype=torch.float64)
    assert torch.equal(M, want)
    # each compression block spreads l raw tokens; paper weights [1,2,2,2,1]*d for the defaults
    Md = overlap_matrix(8, 2, 32, 16, 64)
    assert torch.equal(Md.sum(1)[:3], torch.full((3,), 32.0, dtype=torch.float64))
    assert Md[:, 1].tolist() == [0, 0, 0, 16, 32, 32, 32, 16]


def test_block_scores_one_hot_and_sum():
    p = NSAParams(**{**TINY, "n_sel": 2})
    p_cmp = torch.zeros(1, 1, 1, 4, dtype=torch.float64)
    p_cmp[..., 1] = 1.0  # all mass on compression block 1 = tokens [2, 6)
    s = reference_block_scores(p_cmp, 3, p)
    assert s.flatten().tolist() == [1.0, 1.0, 0.0]
    # group of 3 heads with random probabilities: scores sum to G * l / d
    pr = torch.rand(2, 1, 3, 4, dtype=torch.float64).softmax(-1)
    assert torch.allclose(reference_block_scores(pr, 3, p).sum(-1), torch.full((2, 1), 6.0,
                                                                                dtype=torch.float64))


def test_hand_computed_tiny_case():
    xs = _tiny_inputs()
    q, kc, vc, ks, vs, kw, vw, g = xs
    o, idx, br = nsa_reference(*xs, **TINY, return_branches=True)
    mean = lambda x, rows: x[0, rows, 0].mean(0)  # noqa: E731
    # compressed: nothing visible before t = l - 1 = 3 -> exactly 0; then uniform over visible blocks
    assert torch.count_nonzero(br["o_cmp"][0, :3]) == 0
    n_vis = {3: 1, 4: 1, 5: 2, 6: 2, 7: 3, 8: 3, 9: 4}
    for t, n in n_vis.items():
        assert torch.allclose(br["o_cmp"][0, t, 0], mean(vc, list(range(n))))
    # t = 9: uniform p over 4 blocks gives scores [0.75, 1.0, 0.25]; block 1 scores highest but
    # n_sel = 2 keeps the forced blocks by priority: the block of t (2), then block 0
    assert idx[0, 9, 0].tolist() == [0, 2]
    assert idx[0, 2, 0].tolist() == [0, -1]  # only block 0 eligible
    assert idx[0, 5, 0].tolist() == [0, 1]
    assert torch.allclose(br["o_slc"][0, 9, 0], mean(vs, [0, 1, 2, 3, 8, 9]))
    assert torch.allclose(br["o_slc"][0, 2, 0], mean(vs, [0, 1, 2]))
    assert torch.allclose(br["o_win"][0, 9, 0], mean(vw, [7, 8, 9]))
    assert torch.allclose(br["o_win"][0, 1, 0], mean(vw, [0, 1]))
    gt = g[0, 9, 0]
    want = gt[0] * br["o_cmp"][0, 9, 0] + gt[1] * br["o_slc"][0, 9, 0] + gt[2] * br["o_win"][0, 9, 0]
    assert torch.allclose(o[0, 9, 0], want)


def test_scores_seen_by_selection_match_hand_values():
    xs = _tiny_inputs()
    _, _, br = nsa_reference(*xs, **{**TINY, "n_sel": 3}, return_branches=True)
    assert torch.allclose(br["scores"][9].flatten(), torch.tensor([0.75, 1.0, 0.25], dtype=torch.float64))
    assert torch.count_nonzero(br["scores"][2]) == 0


@pytest.mark.parametrize("n_sel,want", [(1, [7]), (2, [0, 7]), (3, [0, 6, 7]), (4, [0, 2, 6, 7]),
                                        (5, [0, 2, 3, 6, 7]), (6, [0, 2, 3, 4, 6, 7])])
def test_selection_rule_forced_then_score_then_lower_index(n_sel, want):
    p = NSAParams(l=4, d=2, l_sel=4, n_sel=n_sel, w=3)
    # t = 30 -> current block 7; blocks 2 and 3 tie exactly, 4 is below them
    scores = [0.0, 0.5, 0.9, 0.9, 0.6, 0.2, 0.0, 0.0]
    assert reference_select_one(scores, 30, p, G=1) == want


def test_selection_rule_padding_and_grid_ties():
    p = NSAParams(l=4, d=2, l_sel=4, n_sel=4, w=3)
    assert reference_select_one([0.3, 0.7], 5, p, G=1) == [0, 1, -1, -1]
    # differences below the comparison grid (2**-20 of the total mass) are ties -> lower index
    s = [0.0, 0.5, 0.5 + 1e-12, 0.4, 0.0, 0.0]
    p2 = NSAParams(l=4, d=2, l_sel=4, n_sel=4, w=3)
    assert reference_select_one(s, 22, p2, G=1) == [0, 1, 4, 5]
    s[2] = 0.5 + 1e-4  # a real difference wins
    assert reference_select_one(s, 22, p2, G=1) == [0, 2, 4, 5]


def _gates(xs, which: int) -> torch.Tensor:
    g = torch.zeros_like(xs[-1])
    g[..., which] = 1.0
    return g


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_full_window_equals_causal_attention(backend):
    T = 45
    xs = make_inputs(2, T, 6, 2, 16, 8, l=8, d=4, seed=1)
    xs[-1] = _gates(xs, 2)
    o, _ = nsa_attention(*xs, l=8, d=4, l_sel=8, n_sel=2, w=T, backend=backend)
    want = causal_attention(xs[0].double(), xs[5].double(), xs[6].double())
    assert (o.double() - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_full_selection_equals_causal_attention(backend):
    T = 45  # n_sel * l_sel = 6 * 8 = 48 >= T: every eligible block is selected
    xs = make_inputs(2, T, 6, 2, 16, 8, l=8, d=4, seed=2)
    xs[-1] = _gates(xs, 1)
    o, idx = nsa_attention(*xs, l=8, d=4, l_sel=8, n_sel=6, w=5, backend=backend)
    want = causal_attention(xs[0].double(), xs[3].double(), xs[4].double())
    assert (o.double() - want).abs().max().item() <= 1e-5
    n_valid = (idx >= 0).sum(-1)[0, :, 0]
    assert n_valid.tolist() == [min(6, t // 8 + 1) for t in range(T)]


def test_reference_returns_input_dtype_and_shapes():
    xs = make_inputs(1, 20, 4, 2, 8, 6, l=8, d=4, dtype=torch.bfloat16)
    o, idx = nsa_reference(*xs, l=8, d=4, l_sel=8, n_sel=3, w=5)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 20, 4, 6)
    assert idx.dtype == torch.int64 and idx.shape == (1, 20, 2, 3)
