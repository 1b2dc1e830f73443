"""The Triton kernels' query-offset route (context parallelism's op call) against nsa_reference(pos0=...).

Queries q [B, Tq, HQ, dk] sit at positions pos0 .. pos0+Tq-1 of keys k_slc [B, pos0+Tq, H, *], a window
buffer from win_pos0 and the compressed tokens before pos0+Tq (nsa.ops.testing.decode_views cuts them out of
one sequence). The planner sends every such call to route.offset_route; the forward output, block_idx and
every gradient must equal the fp64 oracle's at the kernel tests' tolerances. Offsets split selection and
compression blocks, the first queries may see no compressed token, the window buffer may or may not be cut.
Last, cp_nsa_attention with a Triton policy over gloo (4 CPU processes) equals the one-process Triton op.
"""
import dataclasses
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from nsa.ops.dispatch import BRANCHES, KernelPolicy  # noqa: E402
from nsa.ops.fallbacks import fallback_counts, reset_fallback_counts  # noqa: E402
from nsa.ops.plan import ARCHS, PRESETS, sample_inputs, select_plan  # noqa: E402
from nsa.ops.reference import nsa_reference  # noqa: E402
from nsa.ops.testing import INPUT_NAMES, decode_views, make_inputs, rel_rms  # noqa: E402
from nsa.ops.triton import function as fn  # noqa: E402
from nsa.ops.tuning import tuning_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 5e-3 if DEV == "cuda" else 1e-5, torch.float16: 5e-3}   # tests/test_triton_kernels.py's

# B, T (whole sequence), HQ, H, dk, dv, l, d, l_sel, n_sel, w, pos0, dkdv chunk, dtype, cut window buffer
CASES = {
    # pos0 = 37: inside selection block 2 (l_sel 16) and between compression strides (d 4); window cut at 14
    "g2_splits_blocks": (1, 77, 4, 2, 16, 32, 8, 4, 16, 3, 24, 37, 1024, torch.float32, True),
    # two sequences, G = 1, dK/dV lists walked in chunks of 4 (partials reduced in order)
    "g1_b2_chunked": (2, 50, 2, 2, 32, 16, 16, 8, 16, 4, 16, 21, 4, torch.float32, True),
    # pos0 = 5 < l - 1: the first queries see no compressed token; l_sel 24 is no power of two
    "g3_before_first_cmp": (1, 61, 6, 2, 16, 16, 12, 4, 24, 3, 20, 5, 7, torch.float32, True),
    # one query, G = 16, n_sel = 1; the window buffer is the whole prefix (win_pos0 = 0)
    "g16_one_query_full_window": (1, 40, 16, 1, 16, 16, 8, 8, 8, 1, 8, 39, 1024, torch.float32, False),
    "fp16_g2": (1, 45, 4, 2, 32, 32, 8, 4, 16, 3, 16, 19, 1024, torch.float16, True),
}

pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs fail (conftest)


def offset_inputs(case: str):
    """(the op's eight inputs as leaves, pos0, win_pos0, hyper-parameters, chunk, dtype) of a case."""
    B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, pos0, chunk, dtype, cut = CASES[case]
    xs = make_inputs(B, T, HQ, H, dk, dv, l=l, d=d, dtype=dtype, device=DEV, seed=T + pos0, q_scale=2.0)
    views, _, w0 = decode_views(xs, pos0, T - pos0, w if cut else T + 1, l, d)
    leaves = [v.detach().clone().requires_grad_() for v in views]
    return leaves, pos0, w0, dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w), chunk, dtype


@pytest.mark.parametrize("case", list(CASES))
def test_offset_route_matches_reference(case):
    xs, pos0, w0, hp, chunk, dtype = offset_inputs(case)
    dk = xs[0].shape[-1]
    o, bi = fn.nsa_triton_apply(*xs, **hp, scale=dk ** -0.5, dkdv_chunk=chunk, pos0=pos0, win_pos0=w0)
    ref = [x.detach().double().cpu().requires_grad_() for x in xs]
    ro, rbi = nsa_reference(*ref, **hp, pos0=pos0, win_pos0=w0)
    assert torch.equal(bi.cpu(), rbi), "selected blocks differ from the reference"
    assert o.dtype == dtype and rel_rms(o, ro) <= TOL[dtype]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    got = torch.autograd.grad(o, xs, do)
    want = torch.autograd.grad(ro, ref, do.double().cpu(), allow_unused=True)
    for name, g, r, x in zip(INPUT_NAMES, got, want, xs):
        assert g.shape == x.shape and g.dtype == x.dtype and torch.isfinite(g).all(), name
        r = torch.zeros_like(x, dtype=torch.float64, device="cpu") if r is None else r
        assert r.norm() > 0, f"d{name} of the oracle is 0: the case does not exercise it"
        assert rel_rms(g, r) <= 2 * TOL[dtype], f"d{name}: {rel_rms(g, r):.2e}"


def test_offset_rows_equal_the_whole_sequence_call():
    """The rows pos0.. of one whole-sequence Triton call (the plain route) and the offset call on their own
    agree: the same blocks, the same output up to the kernels' accumulation order."""
    B, T, HQ, H, dk, dv, l, d, l_sel, n_sel, w, pos0, _, dtype, _ = CASES["g2_splits_blocks"]
    xs = make_inputs(B, T, HQ, H, dk, dv, l=l, d=d, dtype=dtype, device=DEV, seed=3, q_scale=2.0)
    hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=dk ** -0.5)
    with torch.no_grad():
        o_all, bi_all = fn.nsa_triton_apply(*xs, **hp)
        views, _, w0 = decode_views(xs, pos0, T - pos0, w, l, d)
        o, bi = fn.nsa_triton_apply(*views, **hp, pos0=pos0, win_pos0=w0)
    assert torch.equal(bi, bi_all[:, pos0:])
    assert rel_rms(o, o_all[:, pos0:]) <= TOL[dtype]


# ------------------------------------------------------------------------------------------- the plan
def route(p) -> str:
    return f"{p.cmp} {p.win}/{p.win_entry} {p.scores} {p.fwd} {p.bwd} {'gluon' if p.walk.gluon else 'triton'}"


def test_every_offset_call_is_planned_on_the_offset_route():
    """Whatever the family, shape, length, preset or grad state, a call with q_off takes route.offset_route: both
    attention branches, the score pass and the selection on the Triton kernels that take the offset, no dq fold,
    no row sums, the Triton walk without pair partials; steps_for maps it to those kernels' steps. Without q_off
    the same inputs keep their golden routes (flash, Gluon, block order, tiles)."""
    plain = set()
    for fam in ARCHS:
        for shape in ("paper", "prod"):
            for T in (4096, 65536):
                for grad in (True, False):
                    inp = sample_inputs(fam, shape, T, grad=grad)
                    for tn in PRESETS.values():
                        p = select_plan(dataclasses.replace(inp, q_off=True), tn)
                        assert route(p) == "triton triton/plain triton token token triton", (fam, shape, T)
                        assert p.q_off and p.m == 1 and not (p.dq_fold or p.row_sums or p.fa4_accum or p.combine)
                        assert not p.walk.dq_pairs and p.needs is None and p.tuning is tn
                        assert "offset" in p.reason("fwd") and p.chunk == select_plan(inp, tn).chunk
                        assert p.line().endswith(" q_off=1") and "q_off" not in select_plan(inp, tn).line()
                        s = fn.steps_for(p)
                        assert (s.cmp_fwd, s.win_fwd, s.slc_fwd, s.slc_bwd) == (
                            fn._attn_fwd, fn._attn_fwd, fn._fwd_token, fn._bwd_token) and not s.fold
                        plain.add(route(select_plan(inp, tn)))
                        assert not select_plan(inp, tn).q_off
    assert len(plain) > 3   # the rule overrides routes that differ


def test_plan_call_marks_an_offset_call():
    xs, *_ = offset_inputs("g2_splits_blocks")
    kw = dict(l=8, d=4, l_sel=16, n_sel=3, w=24)
    assert fn.call_plan(*xs[:5], **kw, q_off=True).q_off and not fn.call_plan(*xs[:5], **kw).q_off


def test_cp_triton_falls_back_to_torch_where_the_kernels_do_not_apply():
    """A dtype the Triton kernels do not take (fp64) runs the torch path under CP, counted."""
    from nsa.dist.context_parallel import _resolve
    pol = triton_policy("float64")
    q, v, g = torch.zeros(1, 4, 2, 8, dtype=torch.float64), torch.zeros(1, 4, 1, 8, dtype=torch.float64), \
        torch.zeros(1, 4, 2, 3, dtype=torch.float64)
    reset_fallback_counts()
    try:
        assert _resolve(pol, q, v, g) == ("torch", pol.tuning)
        assert fallback_counts() == {"cp:triton->torch": 1}
        assert _resolve(triton_policy("float32"), q.float(), v.float(), g.float())[0] == "triton"
    finally:
        reset_fallback_counts()


def triton_policy(dtype: str) -> KernelPolicy:
    """The Triton backend on this device (on CPU the interpreter, which `auto` never picks)."""
    return KernelPolicy("triton", DEV, dtype, {b: "triton" for b in BRANCHES}, {b: "test" for b in BRANCHES}, None,
                        tuning_for(DEV))


# ------------------------------------------------------------------------------- context parallelism
CP_T, CP_DK, CP_HP = 35, 16, dict(l=8, d=4, l_sel=8, n_sel=3, w=12)


@functools.cache
def _one_process_triton():
    """The one-process Triton op on the CP cases' inputs, forward and backward: computed once per spawned process
    and shared by its CP = 4 and CP = 2 cases (same inputs, same interpreter) instead of once per case.
    -> (inputs, output gradient, leaves holding the gradients, output, blocks)"""
    B, T, HQ, H, dk, dv = 1, CP_T, 4, 2, CP_DK, 16
    xs = make_inputs(B, T, HQ, H, dk, dv, l=CP_HP["l"], d=CP_HP["d"], seed=11, q_scale=2.0)
    go = torch.randn(B, T, HQ, dv, generator=torch.Generator().manual_seed(1))
    full = [x.clone().requires_grad_() for x in xs]
    o, idx = fn.nsa_triton_apply(*full, **CP_HP, scale=dk ** -0.5)
    o.backward(go)
    return xs, go, full, o.detach(), idx


def _cp_triton_cases(rank: int, group, cp_rank: int, cp_world: int) -> None:
    """cp_nsa_attention on the Triton policy (offset route for every chunk but rank 0's first) against the
    one-process Triton op: rows, blocks and every gradient. T = 35 at CP = 4 / 2: chunks of 5 / 9 positions split
    compression (l 8, d 4) and selection (l_sel 8) blocks, the last chunk at CP = 4 is padding only."""
    from nsa.dist import cp_nsa_attention, gather_outputs, shard_sequence
    from test_context_parallel import _close, _summed
    T, hp = CP_T, CP_HP
    xs, go, full, o, idx = _one_process_triton()

    def shard(x, pad=0):
        return shard_sequence(x.detach(), cp_rank, cp_world, pad_value=pad)
    loc = [(x if n in ("k_cmp", "v_cmp") else shard(x)).clone().requires_grad_() for n, x in zip(INPUT_NAMES, xs)]
    o_l, idx_l = cp_nsa_attention(*loc, seq_len=T, group=group, **hp, backend=triton_policy("float32"))
    o_l.backward(shard(go))
    tag = f"triton CP={cp_world} rank={cp_rank}"
    assert torch.equal(idx_l, shard(idx, pad=-1)), tag
    _close(o_l, shard(o), TOL[torch.float32], f"{tag} o")
    for n, g_l, x in zip(INPUT_NAMES, loc, full):
        if n in ("k_cmp", "v_cmp"):   # replicated: the ranks' shares sum to the gradient
            _close(_summed(g_l.grad, group), x.grad, TOL[torch.float32], f"{tag} d{n}")
        else:
            _close(g_l.grad, shard(x.grad), TOL[torch.float32], f"{tag} d{n}")
    _close(gather_outputs(o_l.detach(), T, group), o, TOL[torch.float32], f"{tag} gathered o")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU processes run the kernels through the "
                    "interpreter (TRITON_INTERPRET=1, set without CUDA)")
def test_cp_op_on_triton_equals_single_process_triton():
    from test_context_parallel import _spawn
    _spawn(_cp_triton_cases)


# ---------------------------------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("HQ,H,d", [(12, 2, 64), (64, 4, 128)], ids=["prod", "paper"])
def test_gpu_bf16_offset_chunk_matches_fp32_torch(HQ, H, d):
    """A late context-parallel chunk at long context in bf16 (queries 9000 .. 13095 of 16384 keys, the offset inside
    a selection and a compression block) against nsa_torch(pos0) in fp32, as tests/test_triton_gpu.py bounds the
    plain route: rows whose blocks differ at near-ties (at most 1 in 1000) get no output gradient in either run."""
    from nsa.ops.batched import nsa_torch
    from nsa.ops.common import NSAParams
    hp = dict(l=32, d=16, l_sel=64, n_sel=16, w=512)
    T, pos0, tq = 16384, 9000, 4096
    xs = make_inputs(1, T, HQ, H, d, d, l=32, d=16, dtype=torch.bfloat16, device="cuda", seed=HQ, q_scale=2.0)
    views, _, w0 = decode_views(xs, pos0, tq, hp["w"], hp["l"], hp["d"])
    scale = d ** -0.5

    def run(dtype, do, torch_path):
        args = [v.detach().to(dtype).requires_grad_() for v in views]
        if torch_path:
            o, bi = nsa_torch(*args, p=NSAParams(**hp), scale=scale, pos0=pos0, win_pos0=w0)
        else:
            o, bi = fn.nsa_triton_apply(*args, **hp, scale=scale, pos0=pos0, win_pos0=w0)
        return o, bi, torch.autograd.grad(o, args, do.to(dtype)) if do is not None else None

    with torch.no_grad():
        _, bi0, _ = run(torch.bfloat16, None, False)
        _, rbi0, _ = run(torch.float32, None, True)
    same = (bi0 == rbi0).all(-1)                                             # [1, tq, H]
    keep = same.repeat_interleave(HQ // H, dim=2)[..., None]
    do = torch.randn(1, tq, HQ, d, device="cuda", generator=torch.Generator("cuda").manual_seed(3)) * keep
    o, bi, g = run(torch.bfloat16, do, False)
    ro, rbi, rg = run(torch.float32, do, True)
    assert torch.equal(bi, bi0) and same.float().mean().item() >= 0.999
    errs = {"o": rel_rms(o * keep, ro * keep), **{f"d{n}": rel_rms(a, b) for n, a, b in zip(INPUT_NAMES, g, rg)}}
    assert all(v <= 5e-3 for v in errs.values()), errs
