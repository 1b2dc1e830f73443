"""q's gradient folded into the selection's dq kernels (FlashBranchTuning.dq_fold, nsa/ops/triton/qsum.py).

Both flash branches run on the CPU "reference" (fp32 math through the same wiring as FlashAttention-4), so
q's gradient reaches QFork from three places; with dq_fold the NSA backward leaves its dq kernels there and
they add the compressed branch's gradient (gathered back through row_slot) and the window's in their
epilogue. Every selection path that has such an epilogue is taken once (the Triton kernels through the
interpreter), at B = 2 so the batch offsets of the gathered rows count, odd T, G = 2, against the fp64 oracle
(the unfolded sum shares the epilogue's helper, so it is no reference on its own). The branches hand their
gradients over as FA4's fp32 dq accumulators there (FlashBranchTuning.fa4_accum; "reference" writes a stand-in
in FA4's tile layout), so this also checks the kernels' reading of that layout on every path."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

from nsa.ops import branch_sums  # noqa: E402
from nsa.ops.reference import nsa_reference  # noqa: E402
from nsa.ops.testing import make_inputs, rel_rms  # noqa: E402
from nsa.ops.triton import qsum  # noqa: E402
from nsa.ops.triton.function import nsa_triton_apply  # noqa: E402
from nsa.ops.tuning import FlashBranchTuning, SelectTuning, TileTuning, tuning_for  # noqa: E402

# (selection tuning, tile tuning, the deferred tasks expected: names of the kernels' launchers)
PATHS = {
    "per-token dq kernel (no epilogue terms: not deferred)": (SelectTuning(), TileTuning(), 0),
    "dq from the walk's pair partials": (SelectTuning(loop="block"), TileTuning(), 1),
    "query tiles always": (SelectTuning(), TileTuning(m=2), 1),
    "query tiles over block order (tiles win)": (SelectTuning(loop="block"), TileTuning(m=2), 1),
}


@pytest.mark.parametrize("path", list(PATHS))
def test_folded_q_gradient_equals_the_separate_sum(path, monkeypatch):
    select, tile, n_tasks = PATHS[path]
    ran = []
    real = qsum.DeferredDq.run

    def spy(self, *a):
        ran.append(len(self.tasks))
        return real(self, *a)

    monkeypatch.setattr(qsum.DeferredDq, "run", spy)
    made = []   # the flash branches' dq as FA4's fp32 accumulators (fa4_accum.py), the kernels' terms
    real_acc = branch_sums.to_accum
    monkeypatch.setattr(branch_sums, "to_accum", lambda *a: made.append(1) or real_acc(*a))
    x = make_inputs(2, 45, 4, 2, 16, 16, l=8, d=4, seed=7)
    do = torch.randn(2, 45, 4, 16, generator=torch.Generator().manual_seed(3))
    res = []
    for fold in (True, False):
        flash_t = FlashBranchTuning(win="reference", cmp="reference", dq_fold=fold)
        tuning = tuning_for("cpu").replace(flash=flash_t, select=select, tile=tile)
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25, tuning=tuning)
        res.append((o, torch.autograd.grad(o, args, do)))
    assert ran == ([n_tasks] if n_tasks else []), ran
    assert len(made) == 4   # both branches, both runs
    ref = [t.detach().double().requires_grad_() for t in x]
    ro, _ = nsa_reference(*ref, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25)
    rg = torch.autograd.grad(ro, ref, do.double())
    assert rel_rms(res[0][0], res[1][0]) == 0 and rel_rms(res[0][0], ro) <= 1e-5
    for name, a, b, r in zip("q k_cmp v_cmp k_slc v_slc k_win v_win gates".split(), res[0][1], res[1][1], rg):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-6 and rel_rms(a, r) <= 2e-5, name


def test_deferred_kernels_are_skipped_when_q_needs_no_gradient(monkeypatch):
    """Gradients of k / v only: QFork's backward never runs, so neither do the deferred dq kernels, and the
    other gradients are those of the unfolded op."""
    ran = []
    monkeypatch.setattr(qsum.DeferredDq, "run", lambda self, *a: ran.append(1))
    x = make_inputs(1, 33, 4, 2, 16, 16, l=8, d=4, seed=2)
    res = []
    for fold in (True, False):
        tuning = tuning_for("cpu").replace(flash=FlashBranchTuning(win="reference", cmp="reference", dq_fold=fold),
                                           select=SelectTuning(loop="block"))
        args = [t.detach().clone().requires_grad_() for t in x]
        o, _ = nsa_triton_apply(*args, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25, tuning=tuning)
        res.append(torch.autograd.grad(o.square().sum(), args[1:]))
    assert not ran
    for a, b in zip(*res):
        assert rel_rms(a, b) == 0


@pytest.mark.parametrize("reentrant", [False, True])
def test_folded_q_gradient_under_activation_checkpointing(reentrant):
    """The model checkpoints each block (non-reentrant): the recomputed forward makes new QFork / NSA nodes
    and a new DeferredDq, and the backward must still meet the deferred kernels in the node that runs them."""
    from torch.utils.checkpoint import checkpoint

    x = make_inputs(1, 40, 4, 2, 16, 16, l=8, d=4, seed=11)
    tuning = {fold: tuning_for("cpu").replace(
        flash=FlashBranchTuning(win="reference", cmp="reference", dq_fold=fold), select=SelectTuning(loop="block"))
        for fold in (True, False)}
    res = []
    for fold, ckpt in ((True, True), (False, False)):
        args = [t.detach().clone().requires_grad_() for t in x]

        def op(*a, tn=tuning[fold]):
            return nsa_triton_apply(*a, l=8, d=4, l_sel=8, n_sel=2, w=8, scale=0.25, tuning=tn)[0].square().sum()

        (checkpoint(op, *args, use_reentrant=reentrant) if ckpt else op(*args)).backward()
        res.append([a.grad for a in args])
    for name, a, b in zip("q k_cmp v_cmp k_slc v_slc k_win v_win gates".split(), *res):
        assert torch.isfinite(a).all() and rel_rms(a, b) <= 1e-6, name
