"""Fused selection (scores + top-n, nsa/ops/triton/scores.py) against nsa.ops.reference's ranking.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 is set
before triton is imported, as in test_triton_kernels.py); with CUDA natively. block_idx must be
identical to the oracle's: the reference ranks fp64 scores of the same (fp32-rounded) inputs with
nsa.ops.reference.reference_select_one (grid rounding, forced blocks, ties to the lower index).
Shapes are small and awkward (T not a multiple of any block, T < l, G = 1/2/3/16, d_k not a power of
two) and some tiles are shrunk so that a tile spans many chunks, masked and unmasked.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from nsa.ops import common  # noqa: E402
from nsa.ops.reference import nsa_reference, reference_select_one  # noqa: E402
from nsa.ops.triton import scores as tsc  # noqa: E402
from nsa.ops.triton import scores_unfused as tsu  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.tuning import ScoreTile, ScoreTuning  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs fail (conftest)


def cmp_lse(q: torch.Tensor, kc: torch.Tensor, l: int, d: int, scale: float):
    """fp64 logits [B,T,HQ,N], visibility [T,N] and lse [B,T,HQ] (-inf where nothing is visible)."""
    G = q.shape[2] // kc.shape[2]
    logits = torch.einsum("bthk,bnhk->bthn", q.double().cpu(), kc.double().cpu().repeat_interleave(G, 2))
    logits = logits * scale
    T, N = q.shape[1], kc.shape[1]
    vis = (torch.arange(N) * d + l - 1)[None, :] <= torch.arange(T)[:, None]
    logits = logits.masked_fill(~vis[None, :, None, :], float("-inf"))
    return logits, torch.logsumexp(logits, -1) if N else torch.full(q.shape[:3], float("-inf"),
                                                                     dtype=torch.float64)


def reference_idx(q, kc, l, d, l_sel, n_sel, scale):
    """The oracle's block_idx [B,T,H,n_sel], from fp64 p_cmp of the same inputs."""
    B, T, HQ, _ = q.shape
    N, H = kc.shape[1], kc.shape[2]
    G = HQ // H
    p = common.NSAParams(l, d, l_sel, n_sel, max(l_sel, 1))
    logits, lse = cmp_lse(q, kc, l, d, scale)
    nsb = triton.cdiv(T, l_sel)
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None])) if N else logits.new_zeros(B, T, HQ, 0)
    M = common.overlap_matrix(N, nsb, l, d, l_sel)
    sc = torch.einsum("bthi,ij->bthj", probs, M) / d                        # [B,T,HQ,nsb]
    sc = sc.reshape(B, T, H, G, nsb).sum(3).tolist()
    out = [[[reference_select_one(sc[b][t][h], t, p, G) for h in range(H)] for t in range(T)]
           for b in range(B)]
    return torch.tensor(out, dtype=torch.int64), lse


def score_tuning(tile) -> ScoreTuning:
    """One tile (a ScoreTile's fields as a tuple) for every head dim."""
    return ScoreTuning(tile=ScoreTile(*tile), big=ScoreTile(*tile))


def run_case(B, T, HQ, H, dk, l, d, l_sel, n_sel, seed, tile=None, zero=None, relayout=False, **kw):
    g = torch.Generator().manual_seed(seed)
    N = common.num_cmp_tokens(T, l, d)
    q = torch.randn(B, T, HQ, dk, generator=g)
    kc = torch.randn(B, N, H, dk, generator=g)
    if zero == "q":
        q.zero_()
    elif zero == "k":
        kc.zero_()
    scale = dk ** -0.5
    want, lse = reference_idx(q, kc, l, d, l_sel, n_sel, scale)
    got = tsc.select_blocks(q.to(DEV), kc.to(DEV), lse.float().to(DEV), l=l, d=d, l_sel=l_sel,
                            n_sel=n_sel, scale=scale, relayout=relayout,
                            **({} if tile is None and not relayout
                               else dict(tuning=score_tuning(tile or F16))), **kw).cpu()
    assert got.shape == (B, T, H, n_sel) and got.dtype == torch.int64
    bad = (got != want).any(-1).nonzero()
    assert bad.numel() == 0, f"{len(bad)} rows differ, first {bad[0].tolist()}: " \
                             f"{got[tuple(bad[0])].tolist()} vs {want[tuple(bad[0])].tolist()}"
    return got


# tiles: ScoreTile fields (rows, min_keys, warps, stages, map_small, map_big)
SMALL = (16, 16, 4, 1, 0, 1)      # 16 rows, 16-token chunks: many chunks per tile, exact CUDA-core map
DOT = (32, 16, 4, 1, 1, 1)        # tensor-core map even for few tokens
F16 = (32, 16, 4, 1, 2, 2)        # two-pass fp16 map (the GPU default's)

# B, T, HQ, H, dk, l, d, l_sel, n_sel, tile
CASES = {
    "g1_dot_many_chunks": (1, 203, 2, 2, 16, 8, 4, 8, 5, DOT),
    "g2_cuda_small_tile": (1, 150, 4, 2, 24, 8, 4, 8, 4, SMALL),
    "g1_cuda_16_tokens": (1, 130, 2, 2, 16, 8, 4, 8, 5, SMALL),
    "g16_default_tile": (1, 133, 16, 1, 16, 8, 4, 8, 6, None),
    "g16_paper_geometry": (1, 333, 16, 1, 16, 32, 16, 64, 4, None),
    "g3_lsel12_nsel3": (2, 97, 6, 2, 16, 12, 4, 12, 3, SMALL),
    "g6_lc4_r1": (1, 90, 6, 1, 16, 16, 4, 4, 7, SMALL),
    "g2_f16_map": (1, 170, 4, 2, 32, 8, 4, 8, 4, F16),
    "nsel1": (1, 60, 4, 2, 16, 8, 4, 8, 1, SMALL),
    "nsel_above_blocks": (1, 45, 2, 1, 16, 8, 4, 8, 9, SMALL),
    "t_below_l": (2, 6, 4, 2, 16, 8, 4, 8, 2, None),
    "t_1": (1, 1, 2, 1, 16, 8, 4, 8, 3, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_reference(case):
    B, T, HQ, H, dk, l, d, l_sel, n_sel, tile = CASES[case]
    run_case(B, T, HQ, H, dk, l, d, l_sel, n_sel, seed=len(case), tile=tile)


@pytest.mark.parametrize("zero", ["q", "k"])
def test_exact_ties_go_to_lower_index(zero):
    """All-zero q (or k~): p is uniform over the visible tokens, many blocks tie exactly."""
    got = run_case(1, 150, 4, 2, 16, 8, 4, 8, 5, seed=2, tile=SMALL, zero=zero)
    # with ties the lowest non-forced indices win: block 1 is picked once it is not forced
    assert (got[0, 100:, :, 1] == 1).all()


def test_wide_keys_agree():
    """int64 ranking keys (needed past 1024 blocks) pick the same blocks as int32 ones."""
    a = run_case(1, 120, 4, 2, 16, 8, 4, 8, 4, seed=5, tile=SMALL, wide_keys=True)
    b = run_case(1, 120, 4, 2, 16, 8, 4, 8, 4, seed=5, tile=SMALL, wide_keys=False)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="wide_keys"):
        tsc.select_blocks(torch.zeros(1, 8000, 2, 16), torch.zeros(1, 1999, 2, 16), torch.zeros(1, 8000, 2),
                          l=8, d=4, l_sel=4, n_sel=2, scale=1.0, wide_keys=False)


@pytest.mark.parametrize("case", ["g1_dot_many_chunks", "g16_paper_geometry", "g6_lc4_r1", "g2_f16_map",
                                  "nsel_above_blocks", "t_below_l"])
def test_relayout_picks_the_same_blocks(case):
    """Block scores passed through the per-program scratch before ranking (ScoreTuning.relayout): the
    reference's blocks, at one and several chunks per tile."""
    B, T, HQ, H, dk, l, d, l_sel, n_sel, tile = CASES[case]
    run_case(B, T, HQ, H, dk, l, d, l_sel, n_sel, seed=len(case) + 3, tile=tile, relayout=True)


def test_relayout_ties_go_to_lower_index():
    got = run_case(1, 150, 4, 2, 16, 8, 4, 8, 5, seed=2, tile=SMALL, zero="k", relayout=True)
    assert (got[0, 100:, :, 1] == 1).all()


def test_matches_unfused_kernels():
    """The old two-kernel path (score tensor + top-n) gives the same block_idx."""
    B, T, HQ, H, dk, l, d, l_sel, n_sel = 1, 140, 6, 2, 16, 12, 4, 8, 5
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, T, HQ, dk, generator=g).to(DEV)
    kc = torch.randn(B, common.num_cmp_tokens(T, l, d), H, dk, generator=g).to(DEV)
    _, lse = cmp_lse(q, kc, l, d, dk ** -0.5)
    lse = lse.float().to(DEV)
    sc = tsu.block_scores(q, kc, lse, l=l, d=d, l_sel=l_sel, scale=dk ** -0.5)
    old = tsu.select_topn(sc, G=HQ // H, l=l, d=d, l_sel=l_sel, n_sel=n_sel)
    new = tsc.select_blocks(q, kc, lse, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=dk ** -0.5)
    assert torch.equal(old, new)


def test_forward_uses_fused_selection(monkeypatch):
    """NSATritonFunction.forward never builds the score tensor, and still matches the reference."""
    def boom(*a, **k):
        raise AssertionError("the forward must not call the unfused score / top-n kernels")

    monkeypatch.setattr(tsu, "block_scores", boom)
    monkeypatch.setattr(tsu, "select_topn", boom)
    import nsa.ops.triton.function as fn
    for name in ("block_scores", "select_topn"):
        if hasattr(fn, name):
            monkeypatch.setattr(fn, name, boom)
    B, T, HQ, H, dk, l, d, l_sel, n_sel, w = 1, 70, 4, 2, 16, 8, 4, 8, 3, 16
    g = torch.Generator().manual_seed(4)
    N = common.num_cmp_tokens(T, l, d)
    shapes = [(B, T, HQ, dk), (B, N, H, dk), (B, N, H, dk), (B, T, H, dk), (B, T, H, dk), (B, T, H, dk),
              (B, T, H, dk)]
    args = [torch.randn(*s, generator=g) for s in shapes] + [torch.rand(B, T, HQ, 3, generator=g)]
    kw = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w)
    with torch.no_grad():
        _, bi = nsa_triton_apply(*[a.to(DEV) for a in args], **kw, scale=dk ** -0.5)
    _, rbi = nsa_reference(*[a.double() for a in args], **kw)
    assert torch.equal(bi.cpu(), rbi)


def _device_tile_pair(T, HQ, H, dk, field):
    """block_idx of the device's score tile without and with the select_blocks switch `field`, on random bf16
    inputs at paper hyperparameters (lse from the Triton compressed attention)."""

    from nsa.ops.triton import attn
    from nsa.ops.tuning import tuning_for
    l, d, l_sel, n_sel = 32, 16, 64, 16
    g = torch.Generator("cuda").manual_seed(T + HQ)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, T, HQ, dk, generator=g, **bf)
    kc = torch.randn(1, common.num_cmp_tokens(T, l, d), H, dk, generator=g, **bf)
    _, lse = attn.attn_fwd(q, kc, torch.randn_like(kc), stride=d, offset=l - 1, window=0, scale=dk ** -0.5)
    base = tuning_for("cuda").scores
    return [tsc.select_blocks(q, kc, lse, l=l, d=d, l_sel=l_sel, n_sel=n_sel, scale=dk ** -0.5,
                              tuning=base, **{field: v}) for v in (False, True)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("HQ, H, dk", [(64, 4, 128), (12, 2, 64)])
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_relayout_is_bitwise_the_default(T, HQ, H, dk):
    """On the device's own tile (the paper and production shapes, bf16): block scores relaid out before
    ranking move fp32 values and change no arithmetic, so block_idx is bitwise the same as without."""
    a, b = _device_tile_pair(T, HQ, H, dk, "relayout")
    assert torch.equal(a, b)


