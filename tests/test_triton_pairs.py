"""The block-order selection forward (nsa/ops/triton/select_block.py) against the per-token forward
(select.slc_fwd), the fp64 oracle of tests/test_triton_tile.py and, through the whole op, the
per-token op and nsa.ops.reference.

CPU: Triton's interpreter on tiny odd shapes (G = 1, 2, 3, 16; -1 padded rows, ties, chunked token
lists); outputs are NaN-poisoned (conftest), so a slot the merge leaves unwritten fails. GPU (`gpu`):
the production shape in bf16 at 8k and 64k, whole op forward and backward against the per-token op.
"""
import dataclasses
import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

triton = pytest.importorskip("triton")

from test_triton_tile import CASES, DEV, captured_dir, captures_at, case_inputs, oracle, rel_err, tol  # noqa: E402

from nsa.ops import route  # noqa: E402
from nsa.ops.triton import select as tsel  # noqa: E402
from nsa.ops.triton.inversion import work_items  # noqa: E402
from nsa.ops.triton import select_block as sb  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.testing import make_inputs  # noqa: E402
from nsa.ops.tuning import SelectTuning, TileTuning, tuning_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison_allocations")   # unwritten outputs fail (conftest)


def by_block(**kw) -> SelectTuning:
    return SelectTuning(loop="block", **kw)


@pytest.mark.parametrize("case", ["g2_m4_random", "g16_m2_identical", "g2_m1_chunked", "g3_m8_lsel24_chunked",
                                  "fp16_g2_m4"])
def test_pairs_match_per_token_and_oracle(case):
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=sum(map(ord, case)) + 1)
    inv = tsel.invert_selection(bi, l_sel, chunk, ranks=True)
    # 16 rows per step: several steps per chunk, and G=3 / G=16 rows that do not divide ROWS evenly
    o, lse = sb.slc_fwd_pairs(q, k, v, bi, inv, l_sel=l_sel, scale=scale, chunk=chunk,
                              tuning=by_block(pair_rows=16))
    o_tok, lse_tok = tsel.slc_fwd(q, k, v, bi, l_sel=l_sel, scale=scale)
    ro, rlse = oracle(q, k, v, bi, gate, do, l_sel, scale)[:2]
    assert o.dtype == q.dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    for name, a, b, r in (("o", o, o_tok, ro), ("lse", lse, lse_tok, rlse)):
        assert rel_err(a, b) <= tol(dtype), f"{name} vs per-token: {rel_err(a, b):.2e}"
        assert rel_err(a, r) <= tol(dtype), f"{name} vs oracle: {rel_err(a, r):.2e}"


@functools.lru_cache(maxsize=None)
def _walks(case: str, change: tuple) -> tuple:
    """(o, lse, dq, dK, dV) of the block-order walks on a case with 16-row steps, packed heads and the
    select changes given as (field, value) pairs; cached so the packed baseline runs once per case."""
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=sum(map(ord, case)) + 3)
    inv = tsel.invert_selection(bi, l_sel, chunk, ranks=True)
    kw = dict(l_sel=l_sel, scale=scale, chunk=chunk)
    tn = by_block(pair_rows=16, **{"block_dkdv_rows": 16, "pack_heads": True, **dict(change)})
    o, lse = sb.slc_fwd_pairs(q, k, v, bi, inv, **kw, tuning=tn)
    delta = (do * o).sum(-1)
    dqp = sb.pair_buffer(q, n_sel, H, dk, route.pair_plan(tn, 1), dq=True)
    dk_, dv_ = tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gate, inv=inv, dq_pairs=dqp, tuning=tn, **kw)
    dq = sb.pair_dq(q, dqp, inv, n_sel, H, dq=torch.empty_like(q), dq_in=None)
    return o, lse, dq, dk_, dv_


@pytest.mark.parametrize("change", [dict(pack_heads=False), dict(prefetch=True), dict(prefetch=True, block_dkdv_rows=64),
                                    dict(ids_in_regs=True), dict(ids_in_regs=True, pair_chunk=5)],
                         ids=["padded", "prefetch", "prefetch_rows64", "ids", "ids_chunk5"])
@pytest.mark.parametrize("case", ["g3_m8_lsel24_chunked", "g2_m1_chunked", "g1_m16_long_local"])
def test_walk_variants_match_packed(case, change):
    """The walks over a block's token list with one knob changed, against the packed walks the tests
    above run (forward, dq partials, dK/dV): select.pack_heads=False (each token's G head rows padded to a
    power of two, as the per-token kernels hold them) and select.prefetch=True (the dK/dV walk's token ids
    loaded two steps ahead; 16-row steps, so lists of several steps, chunks ending mid-step and one-
    and two-step lists all occur; and 64-row steps, the Hopper preset's, where most lists take one) and
    select.ids_in_regs=True (the forward's token ids from registers, for pieces of <= 256 entries)."""
    outs = [_walks(case, ()), _walks(case, tuple(sorted(change.items())))]
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), *outs):
        assert rel_err(a, b) <= 1e-6, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("case", ["g3_m8_lsel24_chunked", "g16_m2_identical"])
@pytest.mark.parametrize("v_scale", [1.0, 1e6])
def test_fp16_partials_scaled_by_max_v(case, v_scale):
    """select.pair_dtype="fp16": o partials stored as o / max|v| in fp16 and scaled back by the merge:
    within fp16's rounding of the fp32 partials, and finite where v (so o) is far past fp16's range."""
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=5)
    v = v * v_scale
    inv = tsel.invert_selection(bi, l_sel, chunk, ranks=True)
    kw = dict(l_sel=l_sel, scale=scale, chunk=chunk)
    o32, lse32 = sb.slc_fwd_pairs(q, k, v, bi, inv, **kw, tuning=by_block(pair_rows=16))
    o16, lse16 = sb.slc_fwd_pairs(q, k, v, bi, inv, **kw, tuning=by_block(pair_rows=16, pair_dtype="fp16"))
    assert torch.isfinite(o16).all() and o16.abs().max() > 1e3 * (v_scale > 1)
    assert rel_err(o16, o32) <= 1e-3 and rel_err(lse16, lse32) <= 1e-6
    ro = oracle(q, k, v, bi, gate, do, l_sel, scale)[0]
    assert rel_err(o16, ro) <= max(tol(dtype), 1e-3)
    assert sb.pair_buffer(q, n_sel, H, dk, route.pair_plan(by_block(pair_dtype="fp16"), 1), dq=True).dtype == q.dtype


@pytest.mark.parametrize("pair_chunk", [3, 8])
def test_forward_chunk_of_its_own_changes_nothing(pair_chunk):
    """select.pair_chunk: the forward walks its own (shorter) pieces of each block's list, split
    inside a step of QB tokens and off the inversion's chunks; every pair's partial is its own, so o and
    lse are those of the inversion's chunking up to the matmul's rounding (the interpreter's BLAS may
    round a row differently beside other rows), and the oracle's."""
    case = "g3_m8_lsel24_chunked"
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=11)
    inv = tsel.invert_selection(bi, l_sel, 64, ranks=True)
    items = work_items(inv["segoff"], inv["n_pairs"], pair_chunk)
    assert items["w_max"] > inv["w_max"] and int(items["nch"].sum()) <= items["w_max"]
    kw = dict(l_sel=l_sel, scale=scale, chunk=64)
    o0, lse0 = sb.slc_fwd_pairs(q, k, v, bi, inv, **kw, tuning=by_block(pair_rows=16))
    o1, lse1 = sb.slc_fwd_pairs(q, k, v, bi, inv, **kw, tuning=by_block(pair_rows=16, pair_chunk=pair_chunk))
    assert rel_err(o1, o0) <= 1e-6 and rel_err(lse1, lse0) <= 1e-6
    ro, rlse = oracle(q, k, v, bi, gate, do, l_sel, scale)[:2]
    assert rel_err(o1, ro) <= tol(dtype) and rel_err(lse1, rlse) <= tol(dtype)


def test_pair_chunk_is_checked():
    with pytest.raises(ValueError, match="select.pair_chunk"):
        SelectTuning(pair_chunk=-1)
    with pytest.raises(ValueError, match="select.prefetch must be true or false"):
        SelectTuning(prefetch="true")   # a string from a config would otherwise be truthy


@pytest.mark.parametrize("case", ["g2_m1_chunked", "g16_m2_identical", "g3_m8_lsel24_chunked"])
def test_dq_from_pairs_matches_per_token_dq(case):
    """dq summed from the dK/dV walk's pair partials (+ dq_in) against slc_dq; dK/dV unchanged."""
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=sum(map(ord, case)) + 2)
    o, lse = tsel.slc_fwd(q, k, v, bi, l_sel=l_sel, scale=scale)
    delta = (do * o).sum(-1)
    dq_in = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEV)
    kw = dict(l_sel=l_sel, scale=scale)
    dq_ref = tsel.slc_dq(q, k, v, bi, do, lse, delta, gate, dq_in=dq_in.clone(), dq_dtype=torch.float32, **kw)
    dk_ref, dv_ref = tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gate, chunk=chunk, **kw)
    inv = tsel.invert_selection(bi, l_sel, chunk, ranks=True)
    tn = by_block()
    dqp = sb.pair_buffer(q, n_sel, H, dk, route.pair_plan(tn, 1))
    dk_, dv_ = tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gate, chunk=chunk, inv=inv, dq_pairs=dqp, **kw)
    dq = sb.pair_dq(q, dqp, inv, n_sel, H, dq=torch.empty_like(dq_in), dq_in=dq_in)
    assert torch.equal(dk_, dk_ref) and torch.equal(dv_, dv_ref)
    assert rel_err(dq, dq_ref) <= 2 * tol(dtype), f"dq: {rel_err(dq, dq_ref):.2e}"


def test_rank_inverts_the_sorted_pairs():
    """rank[b, h, t, s] is the position of slot s of (b, t, h) in toks (its token there), -1 when empty."""
    q, k, v, do, gate, bi, scale = case_inputs("g2_m1_chunked", seed=5)
    inv = tsel.invert_selection(bi, 8, 4, ranks=True)
    rank, toks = inv["rank"].cpu(), inv["toks"].cpu()
    B, T, H, S = bi.shape
    empty = bi.permute(0, 2, 1, 3).cpu() < 0
    assert ((rank == -1) == empty).all()
    t = torch.arange(T).view(1, 1, T, 1).expand(B, H, T, S)
    assert (toks[rank[~empty]] == t[~empty]).all()
    assert len(set(rank[~empty].tolist())) == int((~empty).sum())   # one position per slot


@pytest.mark.parametrize("dq", [False, True], ids=["walk", "walk_with_dq"])
@pytest.mark.parametrize("case", ["g16_m2_identical", "g2_m1_chunked", "g3_m8_lsel24_chunked"])
def test_walk_loop_stages_change_nothing(case, dq):
    """select.walk_loop_stages / dq_walk_loop_stages: the dK/dV walk without / with dq partials runs its step
    loop as tl.range(num_stages=3): scheduling only, so dK, dV and dq are bitwise the plain loop's (here
    through the interpreter; test_gpu_walk_loop_stages_bitwise checks the compiled one)."""
    B, T, HQ, H, dk, dv, l_sel, n_sel, m, mode, chunk, dtype = CASES[case]
    q, k, v, do, gate, bi, scale = case_inputs(case, seed=sum(map(ord, case)) + 8)
    o, lse = tsel.slc_fwd(q, k, v, bi, l_sel=l_sel, scale=scale)
    delta = (do * o).sum(-1)
    outs = []
    for stages in (0, 3):
        tn = by_block(block_dkdv_rows=16, **{("dq_" if dq else "") + "walk_loop_stages": stages})
        inv = tsel.invert_selection(bi, l_sel, chunk, ranks=True)
        dqp = sb.pair_buffer(q, n_sel, H, dk, route.pair_plan(tn, 1), dq=True) if dq else None
        dk_, dv_ = tsel.slc_dkdv(q, k, v, bi, do, lse, delta, gate, l_sel=l_sel, scale=scale, chunk=chunk,
                                 tuning=tn, inv=inv, dq_pairs=dqp)
        dq_ = sb.pair_dq(q, dqp, inv, n_sel, H, dq=torch.empty_like(q), dq_in=None) if dq else None
        outs.append((dk_, dv_, dq_))
    ref = oracle(q, k, v, bi, gate, do, l_sel, scale)[2:5]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert not dq or torch.equal(outs[0][2], outs[1][2])
    assert rel_err(outs[1][0], ref[1]) <= 2 * tol(dtype) and rel_err(outs[1][1], ref[2]) <= 2 * tol(dtype)
    for bad in (1, 5, True):
        for name in ("walk_loop_stages", "dq_walk_loop_stages"):
            with pytest.raises(ValueError, match=f"select.{name}"):
                SelectTuning(**{name: bad})
    assert route.loop_stages_for(SelectTuning(walk_loop_stages=3), False, 16) == 3
    assert route.loop_stages_for(SelectTuning(walk_loop_stages=3), True, 16) == 0
    # the walk with dq partials pipelined only from dq_walk_loop_min_g query heads per KV head
    g16 = SelectTuning(loop="block", prefetch=True, dq_walk_loop_stages=2, dq_walk_loop_min_g=16)
    assert route.loop_stages_for(g16, True, 16) == 2 and route.loop_stages_for(g16, True, 6) == 0
    assert not route.prefetch_for(g16, 16) and route.prefetch_for(g16, 6)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="select.dq_walk_loop_min_g"):
            SelectTuning(dq_walk_loop_min_g=bad)
    pre = SelectTuning(loop="block", prefetch=True, walk_loop_stages=3)
    assert route.prefetch_for(pre, 2, dq_pairs=True) and not route.prefetch_for(pre, 2, dq_pairs=False)


OP_HP = dict(l=8, d=4, l_sel=8, n_sel=3, w=12)


@functools.lru_cache(maxsize=1)
def op_inputs_and_per_token_result():
    """Inputs [q, k_cmp, ..., gates], dO, and the per-token op's (o, block_idx, grads), computed once."""
    B, T, HQ, H, dk, dv = 2, 53, 6, 2, 16, 16
    xs = make_inputs(B, T, HQ, H, dk, dv, l=OP_HP["l"], d=OP_HP["d"], device=DEV, dtype=torch.float32, seed=7)
    do = torch.randn(B, T, HQ, dv, generator=torch.Generator().manual_seed(8)).to(DEV)
    return xs, do, run_op(xs, do, dataclasses.replace(tuning_for(DEV), tile=TileTuning(m=1)))


def run_op(xs, do, tuning):
    x = [a.detach().clone().requires_grad_() for a in xs]
    o, bi = nsa_triton_apply(*x, **OP_HP, scale=xs[0].shape[-1] ** -0.5, dkdv_chunk=5, tuning=tuning)
    return o, bi, torch.autograd.grad(o, x, do)


# q's dtype for the partials ("input") differs from fp32 only in low precision: the gpu test covers it
@pytest.mark.parametrize("tile", [TileTuning(m=1), TileTuning(m=4)], ids=["block_order", "tiles_over_block"])
def test_op_by_block_matches_per_token_op(tile):
    """The whole op with select.loop=block (forward, and dq from the dK/dV walk's pair partials) against
    the per-token op: same block_idx, o and every gradient; also with query tiles (m=4), which the plan
    takes over block order."""
    xs, do, (o0, bi0, g0) = op_inputs_and_per_token_result()
    o1, bi1, g1 = run_op(xs, do, dataclasses.replace(tuning_for(DEV), select=by_block(pair_rows=32), tile=tile))
    assert torch.equal(bi0, bi1)
    assert rel_err(o1, o0) <= tol(torch.float32)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert rel_err(a, b) <= 2 * tol(torch.float32), f"grad {i}: {rel_err(a, b):.2e}"


def test_op_by_block_with_wide_dkdv_steps_and_tuned_chunk(monkeypatch):
    """Wide dK/dV steps on the block path (block_dkdv_rows=64, packed heads: 21 tokens of 3 each)
    and the list chunk from select.chunk_for (no dkdv_chunk argument: 636 pairs are fewer than 20
    chunks of 40, so 20): same block_idx, o and gradients as the per-token op, and the inversion is
    made with that chunk."""
    from nsa.ops.triton import function as fn
    seen = []
    real = fn.invert_selection
    monkeypatch.setattr(fn, "invert_selection", lambda bi, l_sel, chunk, **kw: seen.append(chunk) or
                        real(bi, l_sel, chunk, **kw))
    xs, do, (o0, bi0, g0) = op_inputs_and_per_token_result()
    sel = by_block(pair_rows=32, block_dkdv_rows=64, chunk=40, chunk_min_items=20, pack_heads=True)
    tn = dataclasses.replace(tuning_for(DEV), select=sel, tile=TileTuning(m=1))
    x = [a.detach().clone().requires_grad_() for a in xs]
    o1, bi1 = nsa_triton_apply(*x, **OP_HP, scale=xs[0].shape[-1] ** -0.5, tuning=tn)
    g1 = torch.autograd.grad(o1, x, do)
    assert seen == [20]
    assert torch.equal(bi0, bi1) and rel_err(o1, o0) <= tol(torch.float32)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert rel_err(a, b) <= 2 * tol(torch.float32), f"grad {i}: {rel_err(a, b):.2e}"


def test_op_token_forward_with_dq_from_pairs(monkeypatch):
    """select.dq_block_max_g above block_max_g (the Hopper preset at G=16): the forward per token, dq
    from the dK/dV walk's pair partials; same block_idx, o and gradients as the per-token op, the
    block-order forward never runs while pair_dq does, and the pair inversion dq needs is made in the
    backward (the forward holds none)."""
    from nsa.ops.triton import function as fn
    xs, do, (o0, bi0, g0) = op_inputs_and_per_token_result()   # before recording: it may run the op here
    calls = []

    def recorded(real, name, *args, **kw):
        calls.append(name)
        return real(*args, **kw)
    for name in ("slc_fwd_pairs", "pair_dq", "slc_fwd", "invert_selection"):
        monkeypatch.setattr(fn, name, functools.partial(recorded, getattr(fn, name), name))
    sel = SelectTuning(loop="auto", block_max_g=2, dq_block_max_g=3, block_dkdv_rows=16)   # G = 3
    tn = dataclasses.replace(tuning_for(DEV), select=sel, tile=TileTuning(m=1))
    with torch.no_grad():
        nsa_triton_apply(*xs, **OP_HP, scale=xs[0].shape[-1] ** -0.5, dkdv_chunk=5, tuning=tn)
    assert calls == ["slc_fwd"]
    calls.clear()
    o1, bi1, g1 = run_op(xs, do, tn)
    assert calls == ["slc_fwd", "invert_selection", "pair_dq"]
    assert torch.equal(bi0, bi1) and rel_err(o1, o0) <= tol(torch.float32)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert rel_err(a, b) <= 2 * tol(torch.float32), f"grad {i}: {rel_err(a, b):.2e}"


def test_auto_picks_block_order_by_group_size():
    tn = SelectTuning(loop="auto", block_max_g=8)
    assert route.by_block(tn, 6) and route.by_block(tn, 8) and not route.by_block(tn, 16)
    assert not route.by_block(SelectTuning(), 1) and route.by_block(SelectTuning(loop="block"), 64)
    hybrid = SelectTuning(loop="auto", block_max_g=8, dq_block_max_g=16)
    assert not route.by_block(hybrid, 16) and route.dq_by_block(hybrid, 16) and not route.dq_by_block(hybrid, 32)
    assert not route.dq_by_block(SelectTuning(loop="token", dq_block_max_g=16), 16)
    assert route.dkdv_rows_for(hybrid, 16) == hybrid.block_dkdv_rows and route.dkdv_rows_for(hybrid, 32) == hybrid.dkdv_rows
    for bad in (dict(block_max_g=-1), dict(dq_block_max_g=2.5), dict(dq_block_max_g=True)):
        with pytest.raises(ValueError, match="max_g"):
            SelectTuning(**bad)
    with pytest.raises(ValueError, match="select.loop"):
        SelectTuning(loop="pairs")
    with pytest.raises(ValueError, match="select.pair_dtype"):
        SelectTuning(pair_dtype="bf16")
    with pytest.raises(ValueError, match="select.dq_pair_dtype"):
        SelectTuning(dq_pair_dtype="bf16")
    q = torch.zeros(1, 4, 6, 8, dtype=torch.bfloat16)
    mixed = SelectTuning(pair_dtype="fp32", dq_pair_dtype="input")
    assert sb.pair_buffer(q, 2, 2, 8, route.pair_plan(mixed, 1)).dtype == torch.float32
    assert sb.pair_buffer(q, 2, 2, 8, route.pair_plan(mixed, 1), dq=True).dtype == torch.bfloat16
    assert sb.pair_buffer(q, 2, 2, 8, route.pair_plan(SelectTuning(pair_dtype="input"), 1), dq=True).dtype == torch.bfloat16


def _by_block_vs_per_token(xs, do, hp: dict, **changes):
    """(block_idx of the per-token op, of the block-order op (the device preset's select with changes),
    [(name, rel. RMS of the block-order op's tensor against the per-token op's)] for o and every gradient)."""
    base = tuning_for("cuda").replace(tile=TileTuning())   # no query tiles on either side (the preset's G=16)
    res = []
    for sel in (dataclasses.replace(base.select, loop="token"),
                dataclasses.replace(base.select, **{"loop": "block", **changes})):
        x = [a.detach().clone().requires_grad_() for a in xs]
        o, bi = nsa_triton_apply(*x, **hp, tuning=dataclasses.replace(base, select=sel))
        res.append((o, bi, torch.autograd.grad(o, x, do)))
    (o0, bi0, g0), (o1, bi1, g1) = res
    names = ("o", "dq", "dk_cmp", "dv_cmp", "dk_slc", "dv_slc", "dk_win", "dv_win", "dgates")
    return bi0, bi1, [(n, rel_err(a, b)) for n, a, b in zip(names, (o1, *g1), (o0, *g0))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
@pytest.mark.parametrize("pdt", ["fp32", "input"])
def test_gpu_op_by_block_matches_per_token_bf16(T, pdt):
    """Production shape (HQ=12, H=2, d=64), bf16, random inputs: o and every gradient of the block-order
    op within 0.5% relative RMS of the per-token op's, block_idx identical."""
    B, HQ, H, dk, l, d, l_sel, n_sel, w = 1, 12, 2, 64, 32, 16, 64, 16, 512
    xs = make_inputs(B, T, HQ, H, dk, dk, l=l, d=d, device="cuda", dtype=torch.bfloat16, seed=1)
    do = torch.randn(B, T, HQ, dk, device="cuda", dtype=torch.bfloat16)
    hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=dk ** -0.5)
    bi0, bi1, errs = _by_block_vs_per_token(xs, do, hp, pair_dtype=pdt, dq_pair_dtype=pdt)
    assert torch.equal(bi0, bi1)
    for name, e in errs:
        assert e <= 5e-3, f"{name}: {e:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_paper_shape_dq_from_pairs(T):
    """Paper shape (HQ=64, H=4, d=128), bf16, random inputs: the forward per token and dq from the dK/dV
    walk's pair partials (loop=auto, dq_block_max_g=16 at G=16, the preset's walk); o and every gradient
    within 0.5% relative RMS of the per-token op's, block_idx identical."""
    B, HQ, H, dk, l, d, l_sel, n_sel, w = 1, 64, 4, 128, 32, 16, 64, 16, 512
    xs = make_inputs(B, T, HQ, H, dk, dk, l=l, d=d, device="cuda", dtype=torch.bfloat16, seed=2)
    do = torch.randn(B, T, HQ, dk, device="cuda", dtype=torch.bfloat16)
    hp = dict(l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=dk ** -0.5)
    bi0, bi1, errs = _by_block_vs_per_token(xs, do, hp, loop="auto", dq_block_max_g=16)
    assert torch.equal(bi0, bi1)
    for name, e in errs:
        assert e <= 5e-3, f"{name}: {e:.2e}"


CAPTURED = captured_dir("NSA_CAPTURED", "captured")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
def test_gpu_op_by_block_on_captured_inputs(T):
    """The same on a trained model's inputs (bench/capture_inputs.py writes them, `bash bench/gpu.sh
    capture-model` on a GPU machine; NSA_CAPTURED points elsewhere): every captured layer at T, with the
    preset's pair dtypes (bf16 o partials failed here: dk_slc 0.4-0.9% off). Also block_idx against the one the model's forward recorded: the same kernels
    under autocast, so equal but for near ties of fp32 scores (>= 99.9% of rows)."""
    entries = captures_at(CAPTURED, T)
    if not entries:
        pytest.skip(f"no captured inputs at T={T} under {CAPTURED} (bash bench/gpu.sh capture-model)")
    for e in entries:
        saved = torch.load(CAPTURED / e["file"], map_location="cuda", weights_only=True)
        xs = [saved[n].contiguous() for n in ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")]
        dk = xs[0].shape[-1]
        hp = {k: e["op"][k] for k in ("l", "d", "l_sel", "n_sel", "w")} | dict(scale=dk ** -0.5)
        do = torch.randn(xs[0].shape[:3] + (xs[6].shape[-1],), device="cuda", dtype=xs[0].dtype,
                         generator=torch.Generator("cuda").manual_seed(T + e["layer"]))
        bi0, bi1, errs = _by_block_vs_per_token(xs, do, hp)
        where = f"T={T} layer {e['layer']}"
        assert torch.equal(bi0, bi1), where
        same = (bi0 == saved["block_idx"]).all(-1).float().mean().item()
        assert same >= 0.999, f"{where}: block_idx equal to the capture's on {same:.4%} of rows"
        for name, err in errs:
            assert err <= 5e-3, f"{where}, {name}: {err:.2e}"


def _work_items_plain(segoff: torch.Tensor, n_pairs: int, chunk: int) -> dict:
    """work_items written as plain torch ops (searchsorted over the chunk counts' prefix sum)."""
    nseg = segoff.numel() - 1
    nch = torch.clamp((segoff[1:] - segoff[:-1] + chunk - 1) // chunk, min=1)
    cum = torch.cumsum(nch, 0)
    w = torch.arange(nseg + (n_pairs + chunk - 1) // chunk, device=segoff.device)
    wseg = torch.searchsorted(cum, w, right=True)
    segc = wseg.clamp(max=nseg - 1)
    return dict(nch=nch, xoff=torch.cumsum(nch - 1, 0) - (nch - 1), wseg=wseg, wchunk=w - (cum[segc] - nch[segc]))


@pytest.mark.parametrize("nseg,chunk", [(1, 4), (7, 3), (1500, 16), (2500, 1)])
def test_work_items_kernels_match_plain_torch(nseg, chunk):
    """The two work-item kernels (chunk counts and prefix sums over segment tiles with a carried total;
    item -> segment by binary search) against the plain torch formula: empty segments, one segment
    holding most entries, more segments than one tile, and spare items past the last."""
    g = torch.Generator().manual_seed(nseg)
    cnt = torch.randint(0, 3 * chunk, (nseg,), generator=g)
    cnt[torch.randint(0, nseg, (max(1, nseg // 5),), generator=g)] = 0
    cnt[nseg // 2] = 40 * chunk + 1
    segoff = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(cnt, 0)]).to(DEV)
    n_pairs = int(segoff[-1]) + 3 * chunk   # listed slots plus empty ones, as segment_lists counts them
    got, want = work_items(segoff, n_pairs, chunk), _work_items_plain(segoff, n_pairs, chunk)
    assert got["w_max"] == want["wseg"].numel() and got["chunk"] == chunk
    for name in ("nch", "xoff", "wseg", "wchunk"):
        assert got[name].dtype == torch.int64 and torch.equal(got[name], want[name]), name
    assert int((got["wseg"] == nseg).sum()) == got["w_max"] - int(want["nch"].sum()) > 0


# case -> (HQ, H, d, the stage knob under test and its stages, other select knobs held in both runs, the tile
# policy that sends the call down the walk the knob changes)
WALK_LOOP_CASES = {
    "paper_tiles": (64, 4, 128, "walk_loop_stages", 3, dict(gluon_walk_stages=0),           # the Triton walk
                    dict()),                                                                # without dq
    "paper_per_token": (64, 4, 128, "dq_walk_loop_stages", 2, dict(gluon_dq_walk_stages=0),  # the Triton walk,
                        dict(m=1)),                                                         # dq partials, G=16
    "production": (12, 2, 64, "dq_walk_loop_stages", 3, dict(dq_walk_loop_min_g=1), {}),   # dq partials, G=6
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [8192, 65536])
@pytest.mark.parametrize("case", list(WALK_LOOP_CASES))
def test_gpu_walk_loop_stages_bitwise(T, case):
    """bf16, random inputs: the op's o and every gradient with the dK/dV walk's step loop as
    tl.range(num_stages=n) bitwise those of the plain loop -- at the paper shape (HQ=64, H=4, d=128) on query
    tiles (the walk without dq, select.walk_loop_stages) and per token (the walk with dq pair partials,
    select.dq_walk_loop_stages), and at the production shape (HQ=12, H=2, d=64, dq partials). What each
    knob needs before the Hopper preset takes it."""
    HQ, H, dk, field, stages, held, tile = WALK_LOOP_CASES[case]
    B, l, d, l_sel, n_sel, w = 1, 32, 16, 64, 16, 512
    xs = make_inputs(B, T, HQ, H, dk, dk, l=l, d=d, device="cuda", dtype=torch.bfloat16, seed=4)
    do = torch.randn(B, T, HQ, dk, device="cuda", dtype=torch.bfloat16)
    base = tuning_for("cuda")
    res = []
    # deterministic algorithms: the dense branches on the own kernels, since flash-attn's and cuDNN's
    # backward accumulate dq / dK in run-dependent order (relative ~1e-6 apart from one run to the next)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for n in (0, stages):
            tn = dataclasses.replace(base, select=dataclasses.replace(base.select, **held, **{field: n}),
                                     tile=dataclasses.replace(base.tile, **tile))
            x = [a.detach().clone().requires_grad_() for a in xs]
            o, bi = nsa_triton_apply(*x, l=l, d=d, l_sel=l_sel, n_sel=n_sel, w=w, scale=dk ** -0.5, tuning=tn)
            res.append((o, bi, torch.autograd.grad(o, x, do)))
    finally:
        torch.use_deterministic_algorithms(was)
    (o0, bi0, g0), (o1, bi1, g1) = res
    assert torch.equal(bi0, bi1) and torch.equal(o0, o1)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert torch.equal(a, b), f"grad {i}: {rel_err(a, b):.2e}"
