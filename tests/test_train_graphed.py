"""The CUDA-graph step (nsa/train/graphed.py) and compiled blocks: equal to the eager step.

CPU: the refusal paths, the host-side lr, and compiled blocks (aot_eager) against eager blocks.
GPU (marker gpu): a graphed run equals an eager run step by step, with stats/poison steps interleaved.
"""
from __future__ import annotations

import copy

import pytest
import torch

from nsa.config import resolve_config
from nsa.model import TinyLM
from nsa.train.graphed import GraphedStep, graph_unsupported, host_lr
from nsa.train.precision import setup_precision
from nsa.train.schedule import build_optimizer, build_scheduler
from nsa.train.step import train_step

TINY = dict(vocab=256, dim=64, n_layers=3, n_heads=4, n_kv_groups=2, d_k=16, d_v=16, l=8, d=4, l_sel=16,
            n_sel=2, w=16)


class _T:  # duck-typed TrainConfig
    def __init__(self, **kw):
        self.lr, self.beta1, self.beta2, self.weight_decay = 1e-2, 0.9, 0.95, 0.1
        self.warmup_steps, self.steps, self.min_lr_ratio = 3, 12, 0.1
        self.__dict__.update(kw)


def _batches(n, b=2, t=64, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (b, t + 1), generator=g).to(device) for _ in range(n)]


def _setup(device, seed=0, **kw):
    torch.manual_seed(seed)
    model = TinyLM(**{**TINY, **kw}).to(device)
    opt = build_optimizer(model, _T())
    return model, opt, build_scheduler(opt, _T())


# ------------------------------------------------------------------------------------------ CPU
def test_refuses_cpu_with_reason():
    model, opt, sched = _setup("cpu")
    prec = setup_precision("fp32", torch.device("cpu"))
    why = graph_unsupported(model, opt, prec, torch.device("cpu"))
    assert why is not None and "CUDA" in why
    with pytest.raises(ValueError, match="runtime.cuda_graph"):
        GraphedStep(model, opt, sched, prec, grad_clip=1.0, device=torch.device("cpu"))


def test_host_lr_follows_schedule_without_reading_tensors():
    model, opt, sched = _setup("cpu")
    prec = setup_precision("fp32", torch.device("cpu"))
    for mb in _batches(5, t=16):
        assert host_lr(sched) == pytest.approx(sched.get_last_lr()[0], rel=1e-12)
        train_step(model, [mb], opt, sched, prec, grad_clip=1.0)
    # with a tensor lr (as GraphedStep installs) the host value still comes from the schedule
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]))
    sched.step()
    assert host_lr(sched) == pytest.approx(float(opt.param_groups[0]["lr"]), rel=1e-6)


def test_config_rejects_zero_graph_warmup():
    with pytest.raises(ValueError, match="cuda_graph_warmup"):
        resolve_config(None, ["runtime.cuda_graph_warmup=0"])


def test_compiled_blocks_match_eager_with_checkpointing():
    """compile_blocks keeps state_dict keys, compiles one graph set for all blocks, and gives the same
    loss and gradients as the eager model (aot_eager: the graph-break structure and autograd, fast)."""
    from torch._dynamo.utils import counters
    m0, _, _ = _setup("cpu", grad_checkpointing=True, backend="torch")
    m1 = copy.deepcopy(m0)
    m1.compile_blocks("aot_eager")
    assert list(m1.state_dict()) == list(m0.state_dict())
    counters.clear()
    ids = _batches(1, t=48)[0]
    grads = []
    for m in (m0, m1):
        for _ in range(2):          # the second pass reuses the compiled graphs
            m.zero_grad(set_to_none=True)
            out = m(ids[:, :-1])
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[1][1], grads[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # blocks share the compiled graphs instead of compiling one set per block
    assert counters["stats"]["unique_graphs"] <= 4 < 2 * len(m1.blocks) * 2


# ------------------------------------------------------------------------------------------ GPU
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_graphed_steps_equal_eager_steps(compiled):
    """Same init, same batches: a graphed run (3 warm-up + capture + replays, with an eager stats step
    and a poisoned step in between) gives the eager run's losses, grad norms and final weights."""
    dev = torch.device("cuda")
    prec = setup_precision("bf16", dev)
    kw = dict(grad_checkpointing=True, backend="triton")
    m0, o0, s0 = _setup(dev, **kw)
    m1, o1, s1 = _setup(dev, **kw)
    if compiled:   # both compiled: this checks capture of inductor code, not inductor vs eager numerics
        m0.compile_blocks("inductor")
        m1.compile_blocks("inductor")
    step = GraphedStep(m1, o1, s1, prec, grad_clip=1.0, device=dev, warmup=3)
    batches = _batches(10, device=dev)
    poison_at, stats_at = 7, 8
    for i, mb in enumerate(batches):
        r0 = train_step(m0, [mb], o0, s0, prec, grad_clip=1.0, poison=i == poison_at)
        r1 = step([mb], poison=i == poison_at, eager=i == stats_at)
        torch.testing.assert_close(r1.loss, r0.loss, rtol=2e-3, atol=2e-3, equal_nan=True)
        torch.testing.assert_close(r1.grad_norm, r0.grad_norm, rtol=2e-2, atol=1e-3, equal_nan=True)
        assert bool(r1.finite) == bool(r0.finite) == (i != poison_at)
        assert host_lr(s1) == pytest.approx(host_lr(s0))
    assert step.graph is not None and step.replays == 10 - 3 - 2   # 3 warm-up, 1 poison, 1 stats
    for a, b in zip(m1.parameters(), m0.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.gpu
@gpu
def test_device_step_timer_measures_gpu_periods_and_skips_gaps():
    """Periods come from completed CUDA events only (no sync), one per consecutive pair of marks; the
    period after a gap() is skipped; a slower step shows a longer period."""
    from nsa.train.reporting import DeviceStepTimer
    dev = torch.device("cuda")
    timer = DeviceStepTimer(dev)
    a = torch.randn(2048, 2048, device=dev)
    for step in range(1, 7):
        for _ in range(8 if step == 5 else 2):
            a = torch.tanh(a @ a)
        timer.mark(step)
        if step == 3:
            timer.gap()
    torch.cuda.synchronize()
    periods = dict(timer.drain())
    assert sorted(periods) == [2, 3, 5, 6]            # 1 has no predecessor, 4 follows the gap
    assert all(ms > 0 for ms in periods.values())
    assert periods[5] > 2 * periods[6]
    assert timer.drain() == []
