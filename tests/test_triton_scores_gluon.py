"""The score pass in Gluon (nsa/ops/triton/scores_gluon.py).

Gluon has no interpreter: on the CPU the ranking kernel runs in Triton's interpreter on stored chunk scores and
must pick the unfused top-n's blocks from the same scores, and the Gluon kernel is compiled for sm_90; on a Hopper
GPU select_blocks through it must return the Triton kernel's block_idx bit for bit.
"""
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from nsa.ops import common  # noqa: E402
from nsa.ops.triton import scores as tsc  # noqa: E402
from nsa.ops.triton import scores_gluon as sg  # noqa: E402
from nsa.ops.triton import scores_unfused as tsu  # noqa: E402
from nsa.ops.triton import tile_gluon as tg  # noqa: E402
from nsa.ops.tuning import ScoreTuning  # noqa: E402
from test_triton_tile_gluon import sm90_reports  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
L, D, LSEL = 32, 16, 64


def stored_chunks(sc: torch.Tensor, T: int) -> tuple[torch.Tensor, int, int]:
    """Block scores [B,H,T,nsb] in the score pass's stored layout: [B*H, tiles, chunks, TILE, NBJ_PAD] fp32
    (chunk c holds blocks c*NBJ ...; the pad column and rows past T hold zeros, never ranked)."""
    B, H, _, nsb = sc.shape
    n_tiles, nchmax = triton.cdiv(T, sg.TILE), triton.cdiv(nsb, sg.NBJ) + 1
    pad = torch.zeros(B, H, n_tiles * sg.TILE, nchmax * sg.NBJ)
    pad[:, :, :T, :nsb] = torch.nan_to_num(sc.float().cpu())   # unranked (ineligible) entries may be unwritten
    blocks = pad.view(B * H, n_tiles, sg.TILE, nchmax, sg.NBJ).permute(0, 1, 3, 2, 4)
    scr = torch.zeros(B * H, n_tiles, nchmax, sg.TILE, sg.NBJ_PAD)
    scr[..., :sg.NBJ] = blocks
    return scr.reshape(-1), n_tiles, nchmax


@pytest.mark.parametrize("B,T,H,n_sel", [(1, 1000, 1, 16), (2, 777, 2, 12), (1, 200, 1, 16), (1, 40, 1, 16)])
def test_ranking_of_stored_chunks_is_the_unfused_top_n(B, T, H, n_sel):
    """The ranking kernel over stored chunks (chunk order, forced blocks, ties to the lower index) picks the
    unfused top-n's blocks from the same scores: odd T, several chunks per tile, tiles past T, T below l_sel."""
    G, dk = sg.GEOMETRY["G"], 16
    g = torch.Generator().manual_seed(T + n_sel)
    q = torch.randn(B, T, G * H, dk, generator=g)
    kc = torch.randn(B, common.num_cmp_tokens(T, L, D), H, dk, generator=g)
    lse = torch.randn(B, T, G * H, generator=g).abs() + 3.0
    sc = tsu.block_scores(q.to(DEV), kc.to(DEV), lse.to(DEV), l=L, d=D, l_sel=LSEL, scale=dk ** -0.5)
    sc = torch.nan_to_num(sc)
    want = tsu.select_topn(sc, G=G, l=L, d=D, l_sel=LSEL, n_sel=n_sel).cpu()
    scr, n_tiles, nchmax = stored_chunks(sc, T)
    got = tsc.rank_stored(scr.to(DEV), B, T, H, G, n_sel, l=L, d=D, l_sel=LSEL, n_tiles=n_tiles, nchmax=nchmax,
                          tile=sg.TILE, nbj=sg.NBJ, nbj_pad=sg.NBJ_PAD, device=DEV).cpu()
    assert torch.equal(got, want)


def test_gluon_score_pass_policy_and_field():
    """The plan takes the Gluon score pass on sm90 at the paper's geometry from gluon_min_t, not off the GPU, off
    that geometry or below it; the field is validated."""
    from nsa.ops.plan import sample_inputs, select_plan
    from nsa.ops.tuning import HOPPER
    t = HOPPER.scores.gluon_min_t
    assert select_plan(sample_inputs("sm90", "paper", t), HOPPER).scores == "gluon"
    assert select_plan(sample_inputs("sm90", "paper", t // 2), HOPPER).scores == "triton"   # below gluon_min_t
    assert select_plan(sample_inputs("cpu", "paper", t), HOPPER).scores == "triton"         # no CUDA
    assert select_plan(sample_inputs("sm80", "paper", t), HOPPER).scores == "triton"        # no Gluon
    assert select_plan(sample_inputs("sm90", "prod", t), HOPPER).scores == "triton"         # G = 6, d = 64
    refused = dataclasses.replace(sample_inputs("sm90", "paper", t), refused=frozenset({"gluon_scores"}))
    assert select_plan(refused, HOPPER).scores == "triton"
    # the stored scores grow as T^2: 1.2 GB at 64k for the paper's four KV heads, past the cap at 128k
    assert sg.scratch_bytes(1, 65536, 4, LSEL) < sg.MAX_SCRATCH_BYTES < sg.scratch_bytes(1, 131072, 4, LSEL)
    with pytest.raises(ValueError, match="gluon_min_t must be >= 0"):
        ScoreTuning(gluon_min_t=-1)


COMPILE = r"""
from nsa.ops.triton import scores_gluon as sg
from nsa.ops.triton.scores import rank_stored
T, HQ, H, D = 2048, 64, 4, 128
q = torch.randn(1, T, HQ, D).bfloat16()
kc = torch.randn(1, (T - 32) // 16 + 1, H, D).bfloat16()
scr, n_tiles, nchmax = sg.score_pass(q, kc, torch.zeros(1, T, HQ), l_sel=64, scale=D ** -0.5)
rank_stored(scr, 1, T, H, 16, 16, l=32, d=16, l_sel=64, n_tiles=n_tiles, nchmax=nchmax, tile=sg.TILE, nbj=sg.NBJ,
            nbj_pad=sg.NBJ_PAD, device="cpu")
for name, _, _, kern in seen:
    rep = br.ptxas_report(kern.asm["ptx"], 90)
    print("REPORT", name, rep["regs"], rep["spill_stores"], kern.metadata.shared)
"""


@pytest.mark.skipif(not tg.gluon_available(), reason="this Triton has no Gluon for Hopper")
def test_gluon_score_pass_compiles_for_sm90():
    """The warp-specialized score pass builds for sm_90 (a few spilled words at most; Triton 3.6, the device's,
    spills none) in one program's share of an SM's 228 KB, and its ranking kernel beside it."""
    reports, err = sm90_reports(COMPILE)
    if reports is None:
        pytest.skip("no ptxas in this Triton")
    lines = {x.split()[1]: [int(v) for v in x.split()[2:]] for x in reports}
    assert set(lines) == {"_score_pass", "_rank_stored_kernel"}, err[-2000:]
    regs, spills, shared = lines["_score_pass"]
    assert spills <= 64 and shared <= 228 * 1024 - 1024, (regs, spills, shared)
    assert lines["_rank_stored_kernel"][1] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,T,n_sel,dtype", [(1, 8192, 16, torch.bfloat16), (1, 65536, 16, torch.bfloat16),
                                             (2, 4000, 12, torch.bfloat16), (1, 5000, 16, torch.float16)])
def test_gpu_gluon_score_pass_is_bitwise_the_triton_kernel(B, T, n_sel, dtype):
    from nsa.ops.fallbacks import fallback_counts
    from nsa.ops.triton import attn
    from nsa.ops.tuning import tuning_for
    if not tg.gluon_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs Gluon on a Hopper GPU")
    HQ, H, dk = 64, 4, 128
    g = torch.Generator("cuda").manual_seed(T + B)
    q = torch.randn(B, T, HQ, dk, generator=g, device="cuda").to(dtype)
    kc = torch.randn(B, common.num_cmp_tokens(T, L, D), H, dk, generator=g, device="cuda").to(dtype)
    _, lse = attn.attn_fwd(q, kc, torch.randn_like(kc), stride=D, offset=L - 1, window=0, scale=dk ** -0.5)
    base = tuning_for("cuda").scores
    before = fallback_counts().get("scores_gluon->triton", 0)
    from nsa.ops.plan import plan_call
    ks = torch.zeros(B, T, H, dk, device="cuda", dtype=dtype)
    tn = tuning_for("cuda").replace(scores=dataclasses.replace(base, gluon_min_t=0))
    assert plan_call(q, kc, kc, ks, ks, l=L, d=D, l_sel=LSEL, n_sel=n_sel, w=512, tuning=tn).scores == "gluon"
    got, want = (tsc.select_blocks(q, kc, lse, l=L, d=D, l_sel=LSEL, n_sel=n_sel, scale=dk ** -0.5, tuning=base,
                                   gluon=g) for g in (True, False))
    assert fallback_counts().get("scores_gluon->triton", 0) == before      # the Gluon pass ran
    assert torch.equal(got, want)
