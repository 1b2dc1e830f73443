"""Query tiles of similar tokens (TileTuning.group, nsa/ops/triton/tile_group.py): the grouping is a
permutation of each window, the kernel and the torch path agree, the unions shrink where selections
cluster, and the op gives bitwise the results of consecutive tiles (every row attends its own blocks)."""
from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from nsa.ops.testing import INPUT_NAMES, make_inputs  # noqa: E402
from nsa.ops.triton import select_tile as tt  # noqa: E402
from nsa.ops.triton import tile_group as tg  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.tuning import TileTuning, tuning_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def clustered(B, T, H, S, topics, seed):
    """block_idx [B,T,H,S] (ascending, distinct, -1 padded) where each token draws its blocks from one of
    `topics` disjoint groups of 2 * S blocks, topics shuffled along T: consecutive tokens share little,
    tokens of a topic a lot; some tokens select fewer blocks."""
    g = torch.Generator().manual_seed(seed)
    topic = torch.randint(0, topics, (B, T, H), generator=g)
    pick = torch.rand(B, T, H, 2 * S, generator=g).argsort(-1)[..., :S]           # S distinct of 2S
    bi = topic[..., None] * 2 * S + pick
    bi = torch.where(torch.rand(B, T, H, S, generator=g) < 0.15, -1, bi)
    key = torch.where(bi >= 0, bi, 1 << 20)
    bi = torch.sort(key, -1).values
    return torch.where(bi == 1 << 20, -1, bi).to(torch.int32).to(DEV)


@pytest.mark.parametrize("T,m,W", [(45, 4, 8), (45, 4, 16), (64, 4, 32), (37, 2, 8), (40, 8, 16)])
def test_grouping_is_a_permutation_of_each_window_and_shrinks_unions(T, m, W):
    B, H, S = 2, 3, 5
    bi = clustered(B, T, H, S, topics=3, seed=T + W)
    perm = tg.group_tokens(bi, m, W)
    want = tg.group_tokens_torch(bi.cpu(), m, W)
    assert perm.dtype == torch.int32 and torch.equal(perm.cpu(), want), "kernel and torch greedy differ"
    tok = torch.arange(T)
    assert torch.equal(torch.sort(want, -1).values, tok.int().expand(B, H, T)), "not a permutation"
    assert ((want.long() // W) == tok // W).all(), "a token left its window"
    if T % W:   # the partial last window keeps its tokens in its first places (positions < T)
        assert (want[..., T // W * W:] >= T // W * W).all()
    grouped = float(tt.tile_union_fraction(tg.permuted(bi, perm), m))
    assert grouped < float(tt.tile_union_fraction(bi, m)) - 0.02
    # the greedy's first tile of each window opens with the window's first token
    assert (want[..., ::W] == tok[::W].int()).all()


def test_greedy_picks_the_token_adding_fewest_blocks():
    """One window (W = 8, T = 4), m = 2: tokens {0, 1, 2}, {5, 6}, {4, 7, 8}, {0, 1, 3}. Token 0 opens the first
    tile; token 3 adds one block to its union, token 1 two, token 2 three: 3 joins. Token 1 opens the next."""
    bi = torch.tensor([[0, 1, 2], [5, 6, -1], [4, 7, 8], [0, 1, 3]], dtype=torch.int32)
    perm = tg.group_tokens(bi.view(1, 4, 1, 3).to(DEV), 2, 8)
    assert perm.view(-1).tolist() == [0, 3, 1, 2]


def test_bad_group_window():
    with pytest.raises(ValueError, match="power of two"):
        tg.group_tokens(torch.zeros(1, 8, 1, 2, dtype=torch.int32), 4, 12)
    with pytest.raises(ValueError, match="TileTuning.group"):
        TileTuning(m=4, group=12)


GROUPED_CASE = dict(B=2, T=109, HQ=8, H=2, dk=16, dv=16, hp=dict(l=8, d=4, l_sel=8, n_sel=5, w=8))


def _grouped_case_run(args, do, **tile):
    """The op on GROUPED_CASE's inputs with TileTuning(m=4, **tile) -> (o, block_idx, every input gradient)."""
    c = GROUPED_CASE
    tn = tuning_for(DEV).replace(tile=TileTuning(m=4, **tile))
    o, bi = nsa_triton_apply(*args, **c["hp"], scale=c["dk"] ** -0.5, tuning=tn)
    return (o, bi) + torch.autograd.grad(o, args, do)


def _grouped_case_inputs():
    c = GROUPED_CASE
    args = [a.requires_grad_() for a in make_inputs(c["B"], c["T"], c["HQ"], c["H"], c["dk"], c["dv"], l=c["hp"]["l"],
                                                     d=c["hp"]["d"], dtype=torch.float32, device=DEV, seed=5)]
    do = torch.randn(c["B"], c["T"], c["HQ"], c["dv"], generator=torch.Generator().manual_seed(6)).to(DEV)
    return args, do


@functools.cache
def _consecutive_tiles():
    """m=4 on consecutive tokens: both group widths compare with it, so it is computed once per module."""
    return tuple(t.detach() for t in _grouped_case_run(*_grouped_case_inputs()))


@pytest.mark.parametrize("W", [8, 16], ids=["w8", "w16"])
def test_op_on_grouped_tiles_is_bitwise_consecutive_tiles(W, monkeypatch):
    """The whole op with TileTuning(m=4, group=W) against m=4 on consecutive tokens: the same block_idx,
    output and every gradient bit for bit (per row the same blocks in the same order; the other rows of a
    tile only change which blocks are masked), with a non-trivial grouping in every (b, h) and the kernels
    reading it (a union of the grouped order with rows read in position order would not match)."""
    T = GROUPED_CASE["T"]
    want = _consecutive_tiles()
    seen = []
    real = tt.tile_unions

    def spy(*a, **k):
        un = real(*a, **k)
        seen.append(un.perm)
        return un

    from nsa.ops.triton import function as fn
    monkeypatch.setattr(fn, "tile_unions", spy)
    args, do = _grouped_case_inputs()
    got = _grouped_case_run(args, do, group=W)
    perm = seen[-1]
    assert perm is not None and (perm != torch.arange(T, device=DEV, dtype=torch.int32)).any(-1).all()
    for name, a, b in zip(["o", "block_idx"] + [f"d{n}" for n in INPUT_NAMES], got, want):
        assert torch.equal(a, b), f"group={W}: {name} differs from consecutive tiles"


def test_block_ids_past_the_mask_fold_and_kernel_matches_torch():
    """Block ids beyond mask_bits(T) fold modulo it (ids 64 apart share a bit at T = 45): the kernel and the
    torch greedy still agree bit for bit, and the result is still a permutation of each window."""
    B, T, H, S, W = 1, 45, 2, 6, 16
    assert tg.mask_bits(T) == 64
    bi = clustered(B, T, H, S, topics=3, seed=11)
    bi = torch.where(bi >= 0, bi + 64 * (torch.arange(T, device=bi.device) % 3).view(1, T, 1, 1).int(), bi)
    perm = tg.group_tokens(bi, 4, W)
    want = tg.group_tokens_torch(bi.cpu(), 4, W)
    assert torch.equal(perm.cpu(), want)
    assert torch.equal(torch.sort(want, -1).values, torch.arange(T).int().expand(B, H, T))
    # the exact bound (ids < 192: 256 bits, no fold) groups differently, kernel and torch alike
    exact = tg.group_tokens(bi, 4, W, n_blocks=192)
    assert torch.equal(exact.cpu(), tg.group_tokens_torch(bi.cpu(), 4, W, tg.mask_bits(192)))
    assert not torch.equal(exact.cpu(), want)
    # the torch greedy sees ids modulo 64 too: folding them first changes nothing
    fold = tg.group_tokens_torch(bi.cpu() % 64 * (bi.cpu() >= 0) - (bi.cpu() < 0).int(), 4, W)
    assert torch.equal(fold, want)
