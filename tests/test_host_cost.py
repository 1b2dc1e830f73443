"""The eager op's host work (issue 45): a repeated call of one signature decides nothing again and runs exactly
its plan's launch sequence, Triton kernels and torch ops that run a kernel alike. Measured on meta tensors with
every kernel a counted no-op (nsa/ops/host_cost.py), planned as an H200 with flash-attn-4 ("sm90": the
production route at 8k, cmp and window on FA4, the selection block by block) and as this CPU (every branch on
the own kernels, the selection token by token)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from nsa.ops import eager, host_cost  # noqa: E402

T = 8192   # the production shape's first target length (meta tensors hold no data: any T costs the same)
FAMILIES = ("sm90", "cpu")


def planned_launches(plan) -> Counter:
    """The Triton kernels one grad-enabled forward + backward of `plan` launches (the token and block routes)."""
    own = (plan.cmp == "triton") + (plan.win == "triton")   # branches on the own attention kernel, fwd + dq + dK/dV
    k = Counter(_attn_fwd_kernel=own, _attn_bwd_dq_kernel=own, _attn_bwd_dkdv_kernel=own,
                _gather_rows_kernel=int(plan.cmp != "triton"),   # q's rows into the dense compressed problem
                _select_kernel=1, _combine_fwd_kernel=1, _gate_bwd_kernel=1,   # scores + top-n, gated sum, dgates
                _seg_chunks_kernel=1, _item_seg_kernel=1, _toks_rank_kernel=1,   # the selection inverted once
                _slc_bwd_dkdv_kernel=1, _slc_reduce_kernel=1)   # the dK/dV walk and its chunk sum
    if plan.fwd == "block":   # pair partials, their merge and dq sum; the pair walk's own items at another chunk
        k += Counter(_pair_fwd_kernel=1, _pair_merge_kernel=1, _pair_dq_kernel=1)
        if plan.tuning.select.pair_chunk not in (0, plan.chunk):
            k += Counter(_seg_chunks_kernel=1, _item_seg_kernel=1)
    else:
        k += Counter(_slc_fwd_kernel=1, _slc_bwd_dq_kernel=1)
    return +k


def planned_compute_ops(plan) -> int:
    """The torch ops (not views, not allocations) of one grad-enabled forward + backward of `plan`, by step."""
    n = 6                              # the selection's keys: >= 0, + bh * nsb, where, cast; sort; searchsorted
    n += 1 + 2 * (plan.bwd != "pairs")   # the gate gradients' columns as contiguous deltas (slc; cmp / win own)
    n += 1                             # dgates cast to the gates' dtype
    if plan.cmp != "triton":           # dense rows: lse gathered + masked; pad rows' dO zeroed, their D zeroed;
        n += 2 + 2 + 1                 # the rows Function's lse gradient (autograd materialises it)
    if plan.win != "triton" and plan.win_gate_lse:
        n += 3                         # the window's D and ln g_win laid out [B, HQ, T] (copy + log)
    n += 2 * plan.fa4_accum            # a zero row standing for q's gradient per branch keeping FA4's accumulator
    if plan.fwd == "block" and plan.pairs.dtype == "fp16":
        n += 2                         # max|v| in fp32, clamped: the fp16 partials' scale
    return n


@pytest.fixture(scope="module", params=FAMILIES)
def measured(request):
    eager._CALLS.clear()
    return host_cost.measure(T, family=request.param, calls=3)


def test_a_repeated_call_decides_nothing(measured):
    """The signature's first call validates, resolves the policy and plans once; the next ones none of it."""
    assert measured["first_planning"]["decide"] == 1 and measured["first_planning"]["plan_call"] == 1
    assert measured["planning"] == {}, measured["planning"]


def test_a_call_launches_its_plans_kernels(measured):
    plan = measured["plan"]
    assert measured["kernels"] == planned_launches(plan), plan.line()
    assert measured["launches_timed"] == measured["launches"]   # every call alike
    assert measured["flash"] == ({"fwd": 2, "bwd": 2} if plan.cmp != "triton" and plan.win != "triton" else {})


def test_a_call_runs_only_its_plans_torch_ops(measured):
    plan = measured["plan"]
    assert sum(measured["compute_ops"].values()) == planned_compute_ops(plan), (plan.line(), measured["compute_ops"])


def test_the_sm90_proxy_plans_the_production_route():
    """The stand-in H200 plans what docs/kernels.md's golden table says for prod at 8k (else the counts above
    would describe another route)."""
    eager._CALLS.clear()
    p = host_cost.measure(T, family="sm90", calls=1)["plan"]
    assert (p.cmp, p.win, p.win_entry, p.scores, p.fwd, p.bwd) == ("fa4", "fa4", "entry", "triton", "block", "pairs")


def test_the_signature_keeps_decisions_apart():
    """Another grad mode, layout or tuning object is another signature: planned again, not served a stale plan."""
    from nsa.ops import nsa_attention
    from nsa.ops.tuning import PRESETS
    eager._CALLS.clear()
    x = host_cost.op_inputs(256, 4, 2, 16, 16, hp=dict(l=8, d=4))
    tally = host_cost.Tally()
    with host_cost.kept_apart(), host_cost.no_kernels(tally, "cpu"):
        nsa_attention(**x, l=8, d=4, l_sel=8, n_sel=2, w=8, tuning=PRESETS["cpu"])
        nsa_attention(**x, l=8, d=4, l_sel=8, n_sel=2, w=8, tuning=PRESETS["cpu"])
        assert tally.planning["decide"] == 1
        with torch.no_grad():
            nsa_attention(**x, l=8, d=4, l_sel=8, n_sel=2, w=8, tuning=PRESETS["cpu"])
        assert tally.planning["decide"] == 2 and not tally.plan.row_sums   # no gradient: no row sums
        q = x["q"].detach().transpose(1, 2).contiguous().transpose(1, 2)   # same shape, other strides
        nsa_attention(**{**x, "q": q}, l=8, d=4, l_sel=8, n_sel=2, w=8, tuning=PRESETS["cpu"])
        nsa_attention(**x, l=8, d=4, l_sel=8, n_sel=2, w=8, tuning=PRESETS["cpu"].replace())
        assert tally.planning["decide"] == 4
    assert not eager._CALLS   # the stand-ins' decisions are forgotten


# ------------------------------------------------------------------------------------------------ decode
@pytest.fixture(scope="module", params=[("op", 1), ("op", 16), ("layer", 1)])
def decode_measured(request):
    form, B = request.param
    return host_cost.measure_decode(65536, B, family="sm90", calls=3, form=form)


def test_a_repeated_decode_call_decides_nothing(decode_measured):
    """The first call validates, resolves the policy, builds the launcher and plans its geometry; the next ones
    none of it, but the layer's (one token further each) a new geometry every l_sel tokens (plan_caps)."""
    first = decode_measured["first_planning"]
    assert (first["decode_decide"], first["decode_launcher"], first["decode_geometry"]) == (1, 1, 1), first
    again = decode_measured["planning"]
    if decode_measured["form"] == "op":
        assert again == {}, again
    else:
        steps = 2 * 3 + host_cost.DECODE_HP["d"]   # timed, profiled and counted calls
        assert set(again) <= {"decode_geometry"} and again.get("decode_geometry", 0) <= 1 + steps // 64, again


def test_a_decode_call_launches_four_kernels_and_allocates_its_outputs(decode_measured):
    """Per call: the four decode kernels, the outputs o and block_idx allocated (the split-K scratch is kept),
    no other torch op in the op; the layer adds its cache writes (k, v of three streams: 6 copies), the six
    views and, every d steps, one compression (unfold and the stand-in phi per k / v)."""
    assert decode_measured["kernels"] == {k: 1 for k in ("_cmp_kernel", "_score_kernel", "_slc_win_kernel",
                                                          "_combine_kernel")}
    assert decode_measured["launches_timed"] == 4
    if decode_measured["form"] == "op":   # through the kept compiled kernels, no argument binding
        assert decode_measured["direct"] == decode_measured["kernels"]
    d = host_cost.DECODE_HP["d"]
    if decode_measured["form"] == "op":
        assert decode_measured["ops"] == {"aten.empty": 2}
    else:
        assert decode_measured["compute_ops"] == {"aten.copy_": 6 + 2 / d, "aten.unfold": 2 / d, "aten.mean": 2 / d}


def test_signature_caches_start_over_when_full():
    """The prefill and decode ops keep decisions in caches of one kind, each its own, dropped whole when full."""
    from nsa.ops import decode, eager
    c = eager.SignatureCache(cap=2)
    c.keep((1,), "a")
    c.keep((2,), "b")
    assert dict(c) == {(1,): "a", (2,): "b"}
    c.keep((3,), "c")
    assert dict(c) == {(3,): "c"}
    assert isinstance(eager._CALLS, eager.SignatureCache) and isinstance(decode._CALLS, eager.SignatureCache)
    assert eager._CALLS is not decode._CALLS
