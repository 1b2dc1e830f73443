"""Eager op calls served from per-signature graphs (nsa/ops/eager_graph.py, NSA_EAGER_GRAPHS=auto).

On CPU the capture backend is faked (FakeGraphs): a "graph" re-runs the captured function and writes what it made
into the storages the capture made, in creation order, as a CUDA graph replay writes into its captured memory, so the
bookkeeping (static inputs, outputs copied out, what the backward reads saved per call and put back) is checked
through the Triton interpreter: interleaved calls of several layers of one signature give the eager path's outputs,
blocks and gradients bitwise. The GPU test checks the same on CUDA graphs and prints the timing."""
from __future__ import annotations

import functools
import time

import pytest
import torch

pytest.importorskip("triton")

from nsa.config.env import eager_graphs  # noqa: E402
from nsa.ops import KernelPolicy, eager, eager_graph, fallbacks, nsa_attention  # noqa: E402
from nsa.ops.dispatch import BRANCHES  # noqa: E402
from nsa.ops.testing import make_inputs  # noqa: E402
from nsa.ops.tuning import FlashBranchTuning, tuning_for  # noqa: E402

HP = dict(l=8, d=4, l_sel=8, n_sel=2, w=8)


class FakeGraphs:
    """Capture = run fn, noting the storages it makes; replay = run fn again and copy each storage it made into the
    capture's one of the same creation rank (where that one is still alive): the captured memory, rewritten."""

    device_type = "cpu"

    def __init__(self, fail: bool = False):
        self.fail, self.captures, self.replays = fail, 0, 0

    def pool(self):
        return object()

    def warm(self, fn):
        fn()

    def capture(self, fn, pool):
        self.captures += 1
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        made, grad = eager_graph.Made(), torch.is_grad_enabled()
        with made:
            out = fn()
        refs = list(made.order.values())

        def replay():   # in the capture's grad mode and saved-tensor hooks (not those around the replay)
            self.replays += 1
            again = eager_graph.Made()
            hooks = torch.autograd.graph.saved_tensors_hooks(eager_graph._detached, eager_graph._same)
            with again, torch.set_grad_enabled(grad), hooks:
                res = fn()   # held until its storages are copied
            new = list(again.order.values())
            assert len(new) == len(refs), "a replay made other storages than its capture"
            for old, fresh in zip(refs, new):
                dst = None if old.expired() else torch.UntypedStorage._new_with_weak_ptr(old.cdata)
                if dst is not None:
                    src = torch.UntypedStorage._new_with_weak_ptr(fresh.cdata)
                    eager_graph._flat(dst).copy_(eager_graph._flat(src))
            del res
        return replay, out


@pytest.fixture
def fake(monkeypatch):
    eager._CALLS.clear()
    eager_graph.clear()
    fallbacks.reset_fallback_counts()
    g = FakeGraphs()
    monkeypatch.setattr(eager_graph, "BACKEND", g)
    monkeypatch.setattr(eager_graph, "ON", True)
    yield g
    eager_graph.clear()
    eager._CALLS.clear()


def policy(flash: dict | None = None) -> KernelPolicy:
    """The Triton route on CPU (the interpreter); flash: branches on a dense kernel outside the Function."""
    tn = tuning_for("cpu") if flash is None else tuning_for("cpu").replace(flash=FlashBranchTuning(**flash))
    return KernelPolicy("triton", "cpu", "float32", {b: "triton" for b in BRANCHES}, {b: "test" for b in BRANCHES},
                        None, tn)


def layers(n: int, T: int = 24, seed: int = 0) -> list[list[torch.Tensor]]:
    return [make_inputs(1, T, 2, 1, 16, 16, l=HP["l"], d=HP["d"], seed=seed + i, requires_grad=True)
            for i in range(n)]


def step(xs: list, pol, grad: bool = True):
    """One 'training step' over the layers: every forward, then one backward through all of them."""
    with torch.set_grad_enabled(grad):
        outs = [nsa_attention(*x, **HP, backend=pol) for x in xs]
    if not grad:
        return outs, []
    loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o, _ in outs)
    gs = torch.autograd.grad(loss, [t for x in xs for t in x], allow_unused=True)
    return outs, gs


def plain_step(n: int, flash: dict | None = None):
    """step(layers(n), policy(flash)) with graphs off: the eager results several tests compare with, computed once
    per module (the inputs are seeded, the eager path is deterministic)."""
    return _plain_step(n, tuple(sorted((flash or {}).items())))


@functools.cache
def _plain_step(n: int, flash: tuple):
    on, eager_graph.ON = eager_graph.ON, False
    try:
        return step(layers(n), policy(dict(flash) or None))
    finally:
        eager_graph.ON = on


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def check_equal(got, want):
    (outs, gs), (outs0, gs0) = got, want
    for (o, bi), (o0, bi0) in zip(outs, outs0):
        assert torch.equal(o, o0) and torch.equal(bi, bi0)
    assert len(gs) == len(gs0) and all(same(a, b) for a, b in zip(gs, gs0))


@pytest.mark.parametrize("flash", [None, dict(win="reference", cmp="reference")], ids=["triton", "win+cmp_outside"])
def test_interleaved_layers_match_eager(fake, flash):
    """Three layers of one signature: the warm-up step runs the first call eagerly and captures at the second; the
    next step replays for all three (each forward overwriting the static memory the previous one used) and still
    gives every output, block and gradient of plain eager calls bitwise."""
    pol, xs = policy(flash), layers(3)
    first, second = step(xs, pol), step(xs, pol)
    assert fake.captures == 2   # forward and backward, once
    assert fake.replays == 2 * 3 + 2 * 3 - 2   # step 1: layers 2-3, step 2: all three, forward and backward each
    g = next(iter(eager_graph._GRAPHS.values()))
    assert not {t.data_ptr() for t in g.out} & {o.data_ptr() for o, _ in second[0]}   # outputs: the caller's own
    assert not any(s.requires_grad for s in g.static)   # the static inputs joined no caller's autograd graph
    plain = plain_step(3, flash)
    check_equal(first, plain)
    check_equal(second, plain)
    assert fallbacks.fallback_counts() == {}


def test_paused_calls_run_as_is(fake):
    """Inside eager_graph.paused() (a whole-step graph's warm-up) calls neither capture nor replay, even repeated and
    under checkpointing's hooks; outside, the next repeated call captures as before."""
    pol, xs = policy(), layers(2)
    with eager_graph.paused():
        plain = step(xs, pol)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            again = step(xs, pol)
    assert fake.captures == 0 and fake.replays == 0 and not eager_graph._GRAPHS
    check_equal(again, plain)
    check_equal(step(xs, pol), plain)
    assert fake.captures == 2


def test_no_grad_and_other_signatures_capture_their_own(fake, monkeypatch):
    """Another grad mode or T is another signature: captured at its own second call (a no-grad call: the forward
    only); MAX_GRAPHS bounds what is kept (the oldest dropped, captured again when it returns)."""
    pol = policy()
    a, b, c = layers(2), layers(2, T=16, seed=5), layers(2, T=32, seed=9)
    step(a, pol, grad=False)
    assert fake.captures == 1   # forward only
    got_a = step(a, pol, grad=False)
    got_b = step(b, pol)
    assert fake.captures == 3   # T=16 with grad: forward + backward
    monkeypatch.setattr(eager_graph, "MAX_GRAPHS", 1)
    step(c, pol, grad=False)    # captured at its second call; the two others dropped
    assert fake.captures == 4 and len(eager_graph._GRAPHS) == 1
    again_a = step(a, pol, grad=False)
    assert fake.captures == 5
    monkeypatch.setattr(eager_graph, "ON", False)
    plain_a = step(a, pol, grad=False)
    check_equal(got_a, plain_a)
    check_equal(again_a, plain_a)
    check_equal(got_b, step(b, pol))


def test_a_failed_capture_runs_eagerly_counted(fake):
    """A capture that raises: that signature runs eagerly from then on (never captured again), each such call
    counted, with the eager results."""
    fake.fail = True
    pol, xs = policy(), layers(3)
    got = step(xs, pol)
    again = step(xs, pol)
    assert fake.captures == 1
    assert fallbacks.fallback_counts() == {eager_graph.FALLBACK: 2 + 3}
    plain = plain_step(3)
    check_equal(got, plain)
    check_equal(again, plain)


def test_a_retained_graph_differentiates_twice(fake, monkeypatch):
    """backward(retain_graph=True) keeps a graphed call's saved state as eager keeps its tensors: a second backward
    gives the same gradients."""
    pol, x = policy(), layers(1)[0]
    nsa_attention(*x, **HP, backend=pol)
    o, _ = nsa_attention(*x, **HP, backend=pol)   # captured and replayed
    assert fake.captures == 2
    do = torch.linspace(-1, 1, o.numel()).view_as(o)
    g1 = torch.autograd.grad(o, x, do, retain_graph=True, allow_unused=True)
    g2 = torch.autograd.grad(o, x, do, allow_unused=True)
    monkeypatch.setattr(eager_graph, "ON", False)
    o0, _ = nsa_attention(*x, **HP, backend=pol)
    g0 = torch.autograd.grad(o0, x, do, allow_unused=True)
    assert all(same(a, c) and same(b, c) for a, b, c in zip(g1, g2, g0))


def test_checkpointed_layers_match_eager(fake, monkeypatch):
    """Layers under non-reentrant activation checkpointing (tinylm's grad_checkpointing): the capture keeps the
    checkpoint's saved-tensor hooks out of its graphs, the recomputation in backward replays, gradients are eager's."""
    from torch.utils.checkpoint import checkpoint
    pol, xs = policy(), layers(2)

    def ckpt_step():
        outs = [checkpoint(lambda *x: nsa_attention(*x, **HP, backend=pol)[0], *x, use_reentrant=False) for x in xs]
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        return outs, torch.autograd.grad(loss, [t for x in xs for t in x], allow_unused=True)

    got = [ckpt_step() for _ in range(2)]
    assert fake.captures == 2 and fallbacks.fallback_counts() == {}
    monkeypatch.setattr(eager_graph, "ON", False)
    plain = ckpt_step()
    for outs, gs in got:
        assert all(torch.equal(o, o0) for o, o0 in zip(outs, plain[0]))
        assert all(same(a, b) for a, b in zip(gs, plain[1]))


def test_a_checkpointed_forward_keeps_its_graph_until_recomputed(fake, monkeypatch):
    """More signatures in one checkpointed forward than MAX_GRAPHS keeps: a graph whose forward replayed is not dropped
    before its recomputation replays it too (else the recomputation runs eagerly and saves other tensors: torch's
    CheckpointError); the signature without room runs eagerly in both. Gradients stay eager's."""
    from torch.utils.checkpoint import checkpoint
    monkeypatch.setattr(eager_graph, "MAX_GRAPHS", 1)
    pol, xs = policy(), [layers(1)[0], layers(1, T=40, seed=5)[0]]

    def ckpt_step():
        outs = [checkpoint(lambda *x: nsa_attention(*x, **HP, backend=pol)[0], *x, use_reentrant=False) for x in xs]
        loss = sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs)
        return outs, torch.autograd.grad(loss, [t for x in xs for t in x], allow_unused=True)

    got = [ckpt_step() for _ in range(2)]
    assert len(eager_graph._GRAPHS) == 1 and all(g.pending == 0 for g in eager_graph._GRAPHS.values())
    monkeypatch.setattr(eager_graph, "ON", False)
    plain = ckpt_step()
    for outs, gs in got:
        assert all(torch.equal(o, o0) for o, o0 in zip(outs, plain[0]))
        assert all(same(a, b) for a, b in zip(gs, plain[1]))


def test_only_nsa_attentions_eager_calls_and_the_triton_route(fake):
    """The custom op's kernels call eager_attention without graphs; the torch backend is not graphed."""
    xs = layers(1)[0]
    for _ in range(3):
        eager.eager_attention(*xs, **HP, backend=policy())
        nsa_attention(*xs, **HP, backend="torch")
    assert fake.captures == 0


def test_the_switch_is_read_from_the_environment():
    assert eager_graphs({}) == "auto" and eager_graphs({"NSA_EAGER_GRAPHS": " Off "}) == "off"
    with pytest.raises(ValueError, match="NSA_EAGER_GRAPHS"):
        eager_graphs({"NSA_EAGER_GRAPHS": "on"})


def test_a_twin_keeps_layout_and_alignment():
    """The static inputs keep the caller's strides and 16-byte offset (the plan was made for those)."""
    base = torch.zeros(2 * 3 * 8 + 5, dtype=torch.bfloat16)
    x = base[3:].as_strided((2, 3, 4), (24, 8, 2))
    t = eager_graph._twin(x)
    assert t.shape == x.shape and t.stride() == x.stride() and t.data_ptr() % 16 == x.data_ptr() % 16


# ---------------------------------------------------------------------------------------------------------- GPU
def gpu_stack(xs, do, graphs: bool, tuning):
    """Forward + backward of a stack of op calls (eager calls; graphs: NSA_EAGER_GRAPHS=auto)."""
    eager_graph.ON = graphs
    outs = [nsa_attention(*x, l=32, d=16, l_sel=64, n_sel=16, w=512, backend="triton", tuning=tuning) for x in xs]
    gs = torch.autograd.grad([o for o, _ in outs], [t for x in xs for t in x], [do] * len(xs), allow_unused=True)
    return outs, gs


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["own_kernels", "production"])
def test_gpu_stack_graphed_matches_eager(route):
    """Three layers of the production shape (B=1, HQ=12, H=2, d=64, bf16) at T=8192, eager against eager-graphed:
    outputs and blocks bitwise; gradients bitwise on the own kernels (no dense or flash-attn branch: their backward
    repeats bitwise), and on the production route (FA4 and cuDNN backwards need not repeat their order of additions)
    within one bf16 rounding of eager, as eager is of itself. Prints one layer's forward + backward time either way (not asserted)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from nsa.ops.testing import rel_rms
    from nsa.ops.tuning import CmpDenseTuning
    tn = tuning_for("cuda")
    tn = tn.replace(cmp_dense=CmpDenseTuning("off"), flash=FlashBranchTuning()) if route == "own_kernels" else tn
    T, saved = 8192, eager_graph.ON
    xs = [[t.cuda().bfloat16().requires_grad_() for t in make_inputs(1, T, 12, 2, 64, 64, l=32, d=16, seed=i)]
          for i in range(3)]
    do = torch.randn(1, T, 12, 64, device="cuda", dtype=torch.bfloat16)
    try:
        eager._CALLS.clear()
        eager_graph.clear()
        fallbacks.reset_fallback_counts()
        want, again = gpu_stack(xs, do, False, tn), gpu_stack(xs, do, False, tn)
        got = [gpu_stack(xs, do, True, tn) for _ in range(3)][-1]   # captured in the first, replayed after
        assert eager_graph._GRAPHS and None not in eager_graph._GRAPHS.values(), fallbacks.fallback_counts()
        for (o, bi), (o0, bi0) in zip(got[0], want[0]):
            assert torch.equal(o, o0) and torch.equal(bi, bi0)
        for a, b, c in zip(got[1], want[1], again[1]):
            if route == "own_kernels" or b is None:
                assert same(a, b)
            else:   # FA4's and cuDNN's backwards add in an order a replay need not repeat: one bf16 rounding at most
                assert rel_rms(a, b) <= 2.0 ** -8 and rel_rms(c, b) <= 2.0 ** -8
        for graphs in (False, True):
            for _ in range(3):
                gpu_stack(xs, do, graphs, tn)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                gpu_stack(xs, do, graphs, tn)
            torch.cuda.synchronize()
            print(f"T={T} route={route} graphs={graphs}: {(time.perf_counter() - t0) / 30 * 1e3:.3f} ms per layer "
                  "fwd+bwd (3-layer stack)")
    finally:
        eager_graph.ON = saved
        eager_graph.clear()
