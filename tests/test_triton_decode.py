"""Triton NSA decode kernel (nsa/ops/triton/decode.py) against the torch prefill / the reference.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 is set
before triton is first imported, as in test_triton_kernels.py). Shapes are tiny; every position
class is covered: before the first compressed token, at each emission boundary and just after,
fewer eligible blocks than n_sel, split-K with one or many chunks, several sub-tiles per chunk.
Every buffer the launcher allocates (outputs and split-K scratch) is NaN/-7 poisoned, so an
unwritten element that is read or returned fails. GPU checks at long context: ``-m gpu``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from nsa.ops import (common, fallback_counts, nsa_attention, nsa_decode,  # noqa: E402
                     reset_fallback_counts)
from nsa.ops.reference import nsa_reference  # noqa: E402
from nsa.ops.testing import decode_views, make_inputs  # noqa: E402
from nsa.ops.triton import decode as tdec  # noqa: E402
from nsa.ops.triton import scores as tsc  # noqa: E402
from nsa.ops.triton import scores_unfused as tsu  # noqa: E402
from nsa.ops.tuning import tuning_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs fail (conftest)


def run_kernel(views, pos0, win_pos0, hp, **kw):
    return tdec.nsa_decode_triton(*views, pos0=pos0, win_pos0=win_pos0, scale=views[0].shape[-1] ** -0.5,
                                  **hp, **kw)


def check(od, id_, o_ref, idx_ref, tol, what):
    assert torch.isfinite(od).all(), what
    assert torch.equal(id_.cpu(), idx_ref.cpu()), (what, id_.flatten().tolist(), idx_ref.flatten().tolist())
    err = (od.double().cpu() - o_ref.double().cpu()).abs().max().item()
    assert err <= tol, (what, err)


# (HQ, H, dk, dv, hparams, T): G = 1, 2, 4; r = l/d in {1, 2}; u = l_sel/d in {2, 4}
CASES = {
    "G1": (2, 2, 16, 8, dict(l=16, d=8, l_sel=16, n_sel=3, w=12), 75),
    "G2": (4, 2, 16, 32, dict(l=8, d=4, l_sel=16, n_sel=4, w=20), 90),
    "G4": (8, 2, 32, 16, dict(l=16, d=16, l_sel=32, n_sel=2, w=16), 100),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    HQ, H, dk, dv, hp, T = CASES[request.param]
    xs = make_inputs(2, T, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=len(request.param) + HQ,
                     q_scale=2.0, device=DEV)
    o, idx = nsa_attention(*xs, **hp, backend="torch")
    return request.param, xs, hp, o, idx


def test_score_constants_match_common():
    """The kernels rank with nsa.ops.common's grid: one definition, imported (not copied)."""
    assert tdec.FORCED_STEP == tsu.FORCED_STEP == common.FORCED_STEP == 2 ** (common.SCORE_BITS + 1)
    assert tsc.GRID_BITS == common.SCORE_BITS + 1


# launch geometries (tests/CPU assume 4 "multiprocessors"): few fat programs (several sub-tiles per
# split-K chunk, several selected blocks / window tiles per program, 2-block scoring slices), many thin
# ones (one sub-tile / block / window tile each, 4-block slices), and the defaults on small tiles
TUNES = tuple(tuning_for(DEV).decode.with_knobs(**kn) for kn in (
    dict(cmp_tile=16, cmp_per_sm=0.25, sw_per_sm=0.25, score_slice=2, tile=16),
    dict(cmp_tile=16, cmp_per_sm=250, sw_per_sm=250, score_slice=4, tile=16),
    dict(cmp_tile=16)))


def test_plans_cover_every_split():
    """The TUNES above really exercise multi-tile loops and multi-program splits on the CASES."""
    seen = set()
    for HQ, H, dk, dv, hp, T in CASES.values():
        for tn in TUNES:
            pl = tdec.decode_plan(rows_h=2 * H, n_cap=common.num_cmp_tokens(T, hp["l"], hp["d"]), s_cap=T,
                                  sms=tdec.CPU_SMS, knobs=tn.small, **hp)
            seen |= {k for k in ("SUBS", "NCH", "NSL", "SPB", "NSS", "WSUB", "NWC") if pl[k] > 1}
            # scoring slices that sort and keep their best KR keys, and slices that keep them all
            seen |= {"SORT" if pl["SL"] > pl["NSEL_P2"] else "KEEP"}
    assert seen == {"SUBS", "NCH", "NSL", "SPB", "NSS", "WSUB", "NWC", "SORT", "KEEP"}


def test_single_token_matches_prefill(case):
    """Positions around every emission boundary class, under each launch geometry of TUNES."""
    name, xs, hp, o, idx = case
    l, d, T = hp["l"], hp["d"], xs[0].shape[1]
    ts = sorted({0, 3, l - 2, l - 1, l, l + d - 1, l + d, 2 * hp["l_sel"] - 1, 2 * hp["l_sel"],
                 T // 2 + 1, T - 2, T - 1})
    for i, t in enumerate(ts):
        views, pos0, win_pos0 = decode_views(xs, t, 1, hp["w"], l, d)
        tn = TUNES[i % len(TUNES)]
        od, id_ = run_kernel(views, pos0, win_pos0, hp, tuning=tn)
        check(od, id_, o[:, t:t + 1], idx[:, t:t + 1], 1e-5, (name, t, tn))


def test_chunked_queries(case):
    """Tq > 1 (chunked prefill through decode): each row at its own position."""
    name, xs, hp, o, idx = case
    for t, tq in ((0, 4), (hp["l"] - 3, 6)):
        views, pos0, win_pos0 = decode_views(xs, t, tq, hp["w"], hp["l"], hp["d"])
        od, id_ = run_kernel(views, pos0, win_pos0, hp, tuning=TUNES[t % 2])
        check(od, id_, o[:, t:t + tq], idx[:, t:t + tq], 1e-5, (name, t, tq))


def test_device_positions_on_capacity_buffers():
    """Positions as device tensors over buffers longer than needed, NaN beyond the valid rows, a
    window buffer starting mid-sequence: the launch depends on capacities only (CUDA-graph form)."""
    HQ, H, dk, dv, hp, T = CASES["G2"]
    xs = make_inputs(1, T, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=5, device=DEV)
    o, idx = nsa_attention(*xs, **hp, backend="torch")
    q, kc, vc, ks, vs, kw, vw, g = xs
    cap = T + 37

    def padded(x, rows):  # [1, rows, H, D] with NaN after x's rows
        out = torch.full((1, rows, *x.shape[2:]), float("nan"), device=DEV)
        out[:, : x.shape[1]] = x
        return out

    ks_c, vs_c = padded(ks, cap), padded(vs, cap)
    kc_c, vc_c = padded(kc, cap // hp["d"]), padded(vc, cap // hp["d"])
    for t, w0 in ((hp["l"] - 2, 0), (61, 40), (T - 1, T - 1 - hp["w"] + 1)):
        kw_c, vw_c = padded(kw[:, w0:t + 1], 2 * hp["w"] + 3), padded(vw[:, w0:t + 1], 2 * hp["w"] + 3)
        kc_c[:, common.num_cmp_tokens(t + 1, hp["l"], hp["d"]):] = float("nan")  # not yet emitted
        pos = torch.tensor([t], device=DEV)
        win = torch.tensor([w0], device=DEV)
        od, id_ = tdec.nsa_decode_triton(q[:, t:t + 1], kc_c, vc_c, ks_c, vs_c, kw_c, vw_c, g[:, t:t + 1],
                                         pos0=pos, win_pos0=win, scale=dk ** -0.5, **hp,
                                         target_programs=3, cmp_tile=16)
        check(od, id_, o[:, t:t + 1], idx[:, t:t + 1], 1e-5, t)
        kc_c[:, : kc.shape[1]] = kc
        vc_c[:, : vc.shape[1]] = vc


def test_ring_window_buffer():
    """win_ring: the window buffer is a ring (position p at row p % ring, NaN in every other row),
    with host-int and device positions; the result equals the linear-buffer decode."""
    HQ, H, dk, dv, hp, T = CASES["G2"]
    xs = make_inputs(2, T, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=9, device=DEV)
    o, idx = nsa_attention(*xs, **hp, backend="torch")
    ring = hp["w"] + 3
    for i, t in enumerate((2, hp["w"] - 1, hp["w"] + 5, T - 1)):
        views, pos0, _ = decode_views(xs, t, 1, hp["w"], hp["l"], hp["d"])
        kr, vr = (torch.full((2, ring, H, x.shape[-1]), float("nan"), device=DEV) for x in xs[5:7])
        p = torch.arange(max(0, t - ring + 1), t + 1)
        kr[:, p % ring], vr[:, p % ring] = xs[5][:, p], xs[6][:, p]
        views[5:7] = [kr, vr]
        pos = torch.tensor([t], device=DEV) if i % 2 else t
        od, id_ = run_kernel(views, pos, None, hp, win_ring=ring, tuning=TUNES[i % 2])
        check(od, id_, o[:, t:t + 1], idx[:, t:t + 1], 1e-5, t)


def test_matches_reference_fp64_oracle():
    HQ, H, dk, dv, hp, T = CASES["G2"]
    xs = make_inputs(1, 70, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=11, device=DEV)
    for t in (hp["l"] - 1, 69):
        views, pos0, win_pos0 = decode_views(xs, t, 1, hp["w"], hp["l"], hp["d"])
        ro, ridx = nsa_reference(*views, **hp, pos0=pos0, win_pos0=win_pos0)
        od, id_ = run_kernel(views, pos0, win_pos0, hp)
        check(od, id_, ro, ridx, 1e-5, t)


def test_ties_go_to_the_lower_block():
    """q = 0: uniform p_cmp, so many blocks tie on the score grid; selection equals the reference."""
    HQ, H, dk, dv, hp, T = CASES["G1"]
    xs = make_inputs(1, T, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=2, device=DEV)
    xs[0] = torch.zeros_like(xs[0])
    views, pos0, win_pos0 = decode_views(xs, T - 1, 1, hp["w"], hp["l"], hp["d"])
    ro, ridx = nsa_reference(*views, **hp, pos0=pos0, win_pos0=win_pos0)
    for tn in TUNES[:2]:  # ties across scoring slices too
        od, id_ = run_kernel(views, pos0, win_pos0, hp, tuning=tn)
        check(od, id_, ro, ridx, 1e-5, ("ties", tn))


def test_many_sorted_scoring_slices():
    """Many blocks, few selected: several scoring slices each sort and keep only their best KR keys,
    and the selection programs take the top n_sel of the union (ties included: q = 0 at one step)."""
    HQ, H, dk, dv = 4, 2, 16, 16
    hp = dict(l=16, d=8, l_sel=16, n_sel=3, w=16)
    xs = make_inputs(1, 300, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=21, q_scale=2.0, device=DEV)
    for t, kn, zero_q in ((299, dict(score_slice=8), False), (250, dict(score_slice=8), False),
                          (299, dict(score_slice=8, sw_per_sm=250), True)):
        tn = tuning_for(DEV).decode.with_knobs(**kn)
        pl = tdec.decode_plan(rows_h=H, n_cap=common.num_cmp_tokens(t + 1, hp["l"], hp["d"]), s_cap=t + 1,
                              sms=tdec.CPU_SMS, knobs=tn.small, **hp)
        assert pl["NSL"] > 1 and pl["SL"] > pl["NSEL_P2"] and pl["NCAND"] < pl["NB_P2"], pl
        x = [torch.zeros_like(xs[0])] + xs[1:] if zero_q else xs
        views, pos0, win_pos0 = decode_views(x, t, 1, hp["w"], hp["l"], hp["d"])
        ro, ridx = nsa_reference(*views, **hp, pos0=pos0, win_pos0=win_pos0)
        od, id_ = run_kernel(views, pos0, win_pos0, hp, tuning=tn)
        check(od, id_, ro, ridx, 1e-5, (t, tn, zero_q))
    # the slices' split-K semaphores are back at zero for the next launch (this device's: a host-cost test in the
    # same process may have left meta-device buffers there)
    mine = [c for c in tdec._COUNTERS.values() if c.device == xs[0].device]
    assert mine and all(int(c.abs().sum()) == 0 for c in mine)


def test_fp16_inputs():
    HQ, H, dk, dv, hp, T = CASES["G2"]
    xs = make_inputs(1, 64, HQ, H, dk, dv, l=hp["l"], d=hp["d"], seed=8, device=DEV)
    x16 = [x.half() for x in xs]
    o, _ = nsa_attention(*[x.float() for x in x16], **hp, backend="torch")
    for t in (hp["l"] + 3, 63):
        views, pos0, win_pos0 = decode_views(x16, t, 1, hp["w"], hp["l"], hp["d"])
        od, id_ = run_kernel(views, pos0, win_pos0, hp, target_programs=3)
        assert od.dtype == torch.float16 and torch.isfinite(od).all()
        ro, ridx = nsa_reference(*[v.float() for v in views], **hp, pos0=pos0, win_pos0=win_pos0)
        assert torch.equal(id_.cpu(), ridx.cpu())
        assert (od.float() - o[:, t:t + 1]).abs().max().item() <= 2e-2


def test_unsupported_dtype_raises_not_implemented():
    HQ, H, dk, dv, hp, T = CASES["G1"]
    xs = make_inputs(1, 20, HQ, H, dk, dv, l=hp["l"], d=hp["d"], dtype=torch.float64, device=DEV)
    views, pos0, win_pos0 = decode_views(xs, 19, 1, hp["w"], hp["l"], hp["d"])
    with pytest.raises(NotImplementedError, match="fp64|float64"):
        run_kernel(views, pos0, win_pos0, hp)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU routing")
def test_dispatch_counts_only_real_fallbacks():
    HQ, H, dk, dv, hp, T = CASES["G1"]
    xs = make_inputs(1, 30, HQ, H, dk, dv, l=hp["l"], d=hp["d"])
    views, pos0, win_pos0 = decode_views(xs, 29, 1, hp["w"], hp["l"], hp["d"])
    reset_fallback_counts()
    for _ in range(3):
        nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **hp)  # auto on CPU: torch is the plan
    assert fallback_counts() == {}
    nsa_decode(*views, pos0=pos0, win_pos0=win_pos0, **hp, backend="triton")  # no CUDA: a fallback
    assert fallback_counts() == {"decode:triton->torch": 1}
    with pytest.raises(ValueError, match="triton"):
        nsa_decode(*views, pos0=torch.tensor([29]), win_pos0=torch.tensor([pos0 - hp["w"] + 1]), **hp)
    reset_fallback_counts()


# ----------------------------------------------------------------------------------------------- GPU
PAPER = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)


def _gpu_cache(B, S, HQ, H, dk, dv, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = common.num_cmp_tokens(S, PAPER["l"], PAPER["d"])

    def r(*s):
        return torch.randn(*s, generator=g, device="cuda").to(dtype)

    # k_slc/v_slc/k_win/v_win as strided views of one [B, S, 4, H, D] buffer (like a fused cache)
    kv = r(B, S, 4, H, max(dk, dv))
    return [r(B, 1, HQ, dk) * 2, r(B, N, H, dk), r(B, N, H, dv), kv[:, :, 0, :, :dk], kv[:, :, 1, :, :dv],
            kv[:, :, 2, :, :dk], kv[:, :, 3, :, :dv], torch.rand(B, 1, HQ, 3, generator=g, device="cuda")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,S,HQ,H,dk,dv", [(2, 65536, 64, 4, 128, 128), (3, 20001, 16, 2, 64, 32),
                                            (1, 8191, 4, 4, 128, 64)])
def test_gpu_bf16_long_context(B, S, HQ, H, dk, dv):
    q, kc, vc, ks, vs, kw, vw, g = _gpu_cache(B, S, HQ, H, dk, dv, seed=S)
    od, id_ = nsa_decode(q, kc, vc, ks, vs, kw, vw, g, pos0=S - 1, win_pos0=0, **PAPER)
    ok_, ik_ = tdec.nsa_decode_triton(q, kc, vc, ks, vs, kw, vw, g, pos0=S - 1, win_pos0=0, scale=dk ** -0.5,
                                      **PAPER)
    assert torch.equal(od, ok_) and torch.equal(id_, ik_)  # the public op (auto on CUDA) runs the kernel
    f = [x.float() for x in (q, kc, vc, ks, vs, kw, vw)]
    ro, ridx = nsa_decode(*f, g, pos0=S - 1, win_pos0=0, **PAPER, backend="torch")
    rows_equal = (id_ == ridx).all(-1).float().mean().item()
    err = ((od.float() - ro).norm() / ro.norm()).item()
    assert torch.isfinite(od).all() and rows_equal >= 0.85 and err <= 1e-2, (rows_equal, err)
    o32, i32 = nsa_decode(*f, g, pos0=S - 1, win_pos0=0, **PAPER)  # fp32 kernel: same blocks
    assert torch.equal(i32, ridx) and ((o32 - ro).norm() / ro.norm()).item() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay_matches_eager():
    B, S, HQ, H, dk, dv = 2, 4096, 16, 2, 64, 64
    q, kc, vc, ks, vs, kw, vw, g = _gpu_cache(B, S, HQ, H, dk, dv, seed=1)
    pos = torch.zeros(1, dtype=torch.int64, device="cuda")
    win = torch.zeros(1, dtype=torch.int64, device="cuda")
    args = dict(pos0=pos, win_pos0=win, **PAPER)
    nsa_decode(q, kc, vc, ks, vs, kw, vw, g, **args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, i_g = nsa_decode(q, kc, vc, ks, vs, kw, vw, g, **args)
    for t in (0, 31, 47, 1000, 3000, S - 1):
        pos.fill_(t)
        graph.replay()
        # same buffers and launch geometry, host-int position: bitwise equal
        oe, ie = tdec.nsa_decode_triton(q, kc, vc, ks, vs, kw, vw, g, pos0=t, win_pos0=0, scale=dk ** -0.5,
                                        **PAPER)
        assert torch.equal(i_g, ie) and torch.equal(o_g, oe), t
        # the public op on exact-length views (other split-K geometry): same blocks, rounding-close
        n = common.num_cmp_tokens(t + 1, PAPER["l"], PAPER["d"])
        oe, ie = nsa_decode(q, kc[:, :n], vc[:, :n], ks[:, :t + 1], vs[:, :t + 1], kw[:, :t + 1],
                            vw[:, :t + 1], g, pos0=t, win_pos0=0, **PAPER)
        assert torch.equal(i_g, ie) and (o_g.float() - oe.float()).abs().max().item() <= 2e-2, t


def test_static_cache_decode_matches_eager_decode():
    """TinyLM over StaticNSACaches (device position, ring window and raw tail, device-side appends,
    the kernel in its CUDA-graph form, no capture) gives the eager cached decode's logits token by
    token: a prompt shorter than l, then emissions of compressed tokens and ring wrap-arounds."""
    from nsa import TinyLM
    torch.manual_seed(0)
    model = TinyLM(vocab=37, dim=32, n_layers=1, n_heads=4, n_kv_groups=2, d_k=16, d_v=16, l=8, d=4,
                   l_sel=8, n_sel=3, w=12, backend="torch").to(DEV).eval()
    T0, n = 5, 17
    ids = torch.randint(0, 37, (2, T0), device=DEV)
    toks = torch.randint(0, 37, (2, n), device=DEV)
    with torch.no_grad():
        ref, caches = model.prefill(ids, capacity=4, last_only=True)
        got, scaches = model.prefill_static(ids, T0 + n)
        assert torch.allclose(got, ref, atol=1e-5)
        pos = torch.tensor([T0], device=DEV)
        for i in range(n):
            ref = model.decode_step(toks[:, i:i + 1], caches)
            got = model.decode_step_static(toks[:, i:i + 1], scaches, pos)
            pos += 1
            assert torch.allclose(got, ref, atol=1e-5, rtol=1e-4), i
    assert scaches[0].k_slc.shape[1] == T0 + n and scaches[0].k_win.shape[1] == 12  # never re-allocated
