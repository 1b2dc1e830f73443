"""Unit tests of nsa.train.step / precision / schedule on a tiny real TinyLM (CPU, seconds)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from nsa.model import TinyLM
from nsa.train.precision import setup_precision
from nsa.train.schedule import build_optimizer, build_scheduler, lr_factor, param_groups
from nsa.train.step import eval_loss, forward_backward, train_step

TINY = dict(vocab=256, dim=32, n_layers=1, n_heads=2, n_kv_groups=1, d_k=16, d_v=16, l=8, d=4, l_sel=8,
            n_sel=2, w=16, backend="torch")


class _T:  # duck-typed TrainConfig
    def __init__(self, **kw):
        self.lr, self.beta1, self.beta2, self.weight_decay = 1e-2, 0.9, 0.95, 0.1
        self.warmup_steps, self.steps, self.min_lr_ratio = 2, 10, 0.1
        self.__dict__.update(kw)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLM(**{**TINY, **kw})


def _batch(b, t=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t + 1), generator=g)


@pytest.fixture(scope="module")
def fp32():
    return setup_precision("fp32", torch.device("cpu"))


# ------------------------------------------------------------------------------------------ schedule
def test_warmup_then_cosine_in_optimizer_steps():
    w, total, floor = 4, 20, 0.1
    f = [lr_factor(s, w, total, floor) for s in range(total)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(f[3:], f[4:]))          # cosine is monotone after warmup
    assert f[-1] == pytest.approx(floor)                        # last step at the floor
    mid = w + (total - w) // 2                                  # k = 12 -> progress 0.5
    assert f[mid - 1] == pytest.approx(floor + (1 - floor) * 0.5)
    assert lr_factor(100, w, total, floor) == pytest.approx(floor)  # past the end: stays at floor


def test_scheduler_counts_optimizer_steps_not_micro_batches(fp32):
    cfg = _T(warmup_steps=2, steps=6)
    m = _model()
    opt = build_optimizer(m, cfg)
    sched = build_scheduler(opt, cfg)
    lrs = []
    for step in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        train_step(m, [_batch(2, seed=step), _batch(2, seed=10 + step)], opt, sched, fp32, grad_clip=1.0)
    expect = [cfg.lr * lr_factor(s, 2, 6, 0.1) for s in range(6)]
    assert lrs == pytest.approx(expect)


def test_no_weight_decay_on_norms_biases_embeddings():
    m = _model(tie_embeddings=True)
    decay, no_decay = param_groups(m, 0.1)
    ids_no = {id(p) for p in no_decay["params"]}
    assert id(m.embed.weight) in ids_no                         # embedding (tied with lm_head) not decayed
    assert all(p.ndim >= 2 for p in decay["params"])
    norms = [p for n, p in m.named_parameters() if "norm" in n]
    assert norms and all(id(p) in ids_no for p in norms)
    n_total = len({id(p) for p in m.parameters()})
    assert len(decay["params"]) + len(no_decay["params"]) == n_total
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


# ------------------------------------------------------------------------------------------ step
def test_accumulation_matches_larger_batch(fp32):
    """accumulate=2 of batch b gives the same grads as accumulate=1 of batch 2b."""
    big = _batch(4, seed=3)
    m1, m2 = _model(), _model()
    l1, tok1 = forward_backward(m1, [big], fp32)
    l2, tok2 = forward_backward(m2, [big[:2], big[2:]], fp32)
    assert tok1 == tok2 == 4 * 32
    assert torch.allclose(l1, l2, atol=1e-6)
    for (n, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(p1.grad, p2.grad, rtol=1e-4, atol=1e-6), n


def test_train_step_reduces_loss_and_returns_device_tensors(fp32):
    cfg = _T(lr=3e-3, warmup_steps=0, steps=30)
    m = _model()
    opt = build_optimizer(m, cfg)
    sched = build_scheduler(opt, cfg)
    batch = _batch(4, seed=5)
    first = None
    for _ in range(30):
        r = train_step(m, [batch], opt, sched, fp32, grad_clip=1.0)
        first = r.loss.clone() if first is None else first
    assert isinstance(r.loss, torch.Tensor) and r.loss.ndim == 0 and r.finite.dtype == torch.bool
    assert float(r.loss) < float(first) - 0.5                  # memorises one batch
    assert bool(r.finite) and math.isfinite(float(r.grad_norm))


def test_grad_norm_is_pre_clip_total_norm(fp32):
    m = _model()
    ref = copy.deepcopy(m)
    batch = _batch(2)
    forward_backward(ref, [batch], fp32)
    total = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in ref.parameters()))
    opt = build_optimizer(m, _T())
    r = train_step(m, [batch], opt, build_scheduler(opt, _T()), fp32, grad_clip=1e-3)
    assert torch.allclose(r.grad_norm, total, rtol=1e-4)


def test_nonfinite_step_is_skipped_without_touching_weights(fp32):
    m = _model()
    opt = build_optimizer(m, _T())
    sched = build_scheduler(opt, _T())
    train_step(m, [_batch(2)], opt, sched, fp32, grad_clip=1.0)   # a normal step creates Adam state
    before = copy.deepcopy(m.state_dict())
    state_before = {k: v.clone() for k, v in opt.state[m.embed.weight].items()}
    r = train_step(m, [_batch(2, seed=9)], opt, sched, fp32, grad_clip=1.0, poison=True)
    assert not bool(r.finite) and math.isnan(float(r.loss))
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in opt.state[m.embed.weight].items():
        assert torch.equal(v, state_before[k]), k                # moments and step count unchanged
    r = train_step(m, [_batch(2, seed=9)], opt, sched, fp32, grad_clip=1.0)
    assert bool(r.finite)                                       # training continues afterwards


def test_eval_loss_keeps_train_mode(fp32):
    m = _model()
    m.train()
    v = eval_loss(m, [_batch(2, seed=s) for s in range(3)], fp32)
    assert m.training and v.ndim == 0 and 4.0 < float(v) < 7.0  # ~ln(256) = 5.55 at init
    assert math.isnan(float(eval_loss(m, [], fp32)))


# ------------------------------------------------------------------------------------------ precision
def test_precision_setup():
    cpu = torch.device("cpu")
    p32 = setup_precision("fp32", cpu)
    assert p32.dtype is None and not p32.uses_scaler
    bf = setup_precision("bf16", cpu)
    assert bf.dtype == torch.bfloat16 and not bf.uses_scaler
    with bf.autocast():
        y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fp16 needs a CUDA"):
        setup_precision("fp16", cpu)
    with pytest.raises(ValueError, match="not one of"):
        setup_precision("fp8", cpu)


def test_bf16_step_keeps_fp32_master_weights():
    bf = setup_precision("bf16", torch.device("cpu"))
    m = _model()
    opt = build_optimizer(m, _T())
    r = train_step(m, [_batch(2)], opt, build_scheduler(opt, _T()), bf, grad_clip=1.0)
    assert bool(r.finite) and r.loss.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in m.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GradScaler fp16 path needs CUDA")
def test_fp16_scaler_knobs_and_backoff():
    p = setup_precision("fp16", torch.device("cuda"), init_scale=1024.0, growth_interval=7,
                        backoff_factor=0.25)
    st = p.scaler.state_dict()
    assert p.uses_scaler and st["scale"] == 1024.0 and st["growth_interval"] == 7
    m = _model().cuda()
    opt = build_optimizer(m, _T())
    r = train_step(m, [_batch(2).cuda()], opt, build_scheduler(opt, _T()), p, grad_clip=1.0, poison=True)
    assert not bool(r.finite) and p.scaler.get_scale() == 256.0   # backed off by 0.25
