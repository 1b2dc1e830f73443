"""One optimizer step: accumulate micro-batches, unscale, clip, skip non-finite updates, step.

No host syncs happen here. Everything that the host wants to know (loss, grad norm, whether the update
was applied) is returned as 0-d device tensors; the Ray loop transfers them every ``log_every`` steps.

Non-finite handling without a sync: ``finite = isfinite(loss) & isfinite(total grad norm)`` is computed
on device and handed to the fused AdamW kernel as ``optimizer.found_inf`` (the attribute GradScaler
uses for the same purpose), which skips the parameter *and* moment update on device when it is 1.
So a NaN/Inf step never corrupts the weights, whatever ``train.on_nonfinite`` says; the policy only
decides what the host does when it next looks (halt at the next log step, or keep going).
For fp16 the GradScaler still backs off its scale on overflow (``scaler.update`` is sync-free too).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from nsa.train.precision import Precision

if TYPE_CHECKING:
    from nsa.train.cp import ContextParallel


@dataclass
class StepResult:
    loss: torch.Tensor        # 0-d fp32, mean over micro-batches of the token-mean CE (device)
    grad_norm: torch.Tensor   # 0-d fp32, global L2 norm of the unscaled grads before clipping (device)
    finite: torch.Tensor      # 0-d bool, True iff the update was applied (device)
    tokens: int               # tokens trained on by this rank in this step (host int from shapes)


IGNORE = -100   # cross_entropy's default ignore_index: skipped targets, and CP's padding (nsa/train/cp.py)


def split_batch(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T+1] packed rows -> inputs [B, T], next-token targets [B, T]. An entry stored as ``~id`` (negative;
    nsa/data/passkey.py's packed mode) is input ``id`` and a target the loss skips."""
    x, y = batch[:, :-1], batch[:, 1:]
    return torch.where(x < 0, ~x, x), torch.where(y < 0, IGNORE, y)


def lm_loss(model: nn.Module, batch: torch.Tensor, prec: Precision,
            cp: Optional["ContextParallel"] = None) -> torch.Tensor:
    """Token-mean next-token cross-entropy of one micro-batch, computed in fp32. Returns a 0-d tensor.
    Under context parallelism (``cp`` active): this rank's share of it (nsa/train/cp.py)."""
    x, y = split_batch(batch)
    if cp is not None and cp.active:
        return cp.lm_loss(model, x, y, prec, IGNORE)
    with prec.autocast():
        logits = model(x)                                   # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)  # mean over scored


def _unwrap_ddp(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _no_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """DDP all-reduces grads in backward; skip it for all but the last micro-batch of a step."""
    if isinstance(model, nn.parallel.DistributedDataParallel) and not last:
        return model.no_sync()
    return contextlib.nullcontext()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _optimizer_step(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """Apply the update iff ``finite``; sync-free with fused AdamW, one deliberate sync otherwise."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.found_inf = (~finite).to(torch.float32)   # read by the fused kernel on device
        optimizer.grad_scale = None                         # grads are already unscaled
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif bool(finite):  # sync-ok: only non-fused optimizers (unsupported device) take this branch
        optimizer.step()


def forward_backward(model: nn.Module, micro_batches: Sequence[torch.Tensor], prec: Precision, *,
                     poison: bool = False, cp: Optional["ContextParallel"] = None) -> tuple[torch.Tensor, int]:
    """Accumulate (scaled) grads of the mean loss over ``micro_batches`` into ``.grad``.

    DDP all-reduces only in the last micro-batch's backward (``no_sync`` for the others). Returns
    (mean loss as a 0-d fp32 device tensor, tokens). ``poison`` multiplies the last loss by NaN.
    ``cp``: each rank back-propagates its share x N (DDP's mean over dp*N ranks then equals the mean over
    replicas, nsa/train/cp.py); the returned loss and tokens are the replica's, as without CP."""
    n = len(micro_batches)
    # CP: one DDP/FSDP over all dp*N ranks (no DP-only group plus a CP-group sum); shares x N make its mean over
    # ranks the mean over replicas of the single-process gradient (tests/test_cp_train.py checks both)
    share = cp.size if cp is not None else 1
    if n == 0:
        raise ValueError("forward_backward needs at least one micro-batch")
    loss_sum = torch.zeros((), dtype=torch.float32, device=micro_batches[0].device)
    tokens = 0
    for i, mb in enumerate(micro_batches):
        last = i == n - 1
        with _no_sync(model, last):
            loss = lm_loss(model, mb, prec, cp)
            if poison and last:
                loss = loss * float("nan")
            # mean of micro-batch means: the mean over all tokens when each scores as many (all but passkey
            # packed rows, where it weights micro-batches alike)
            prec.scaler.scale(loss * (share / n)).backward()
        loss_sum += loss.detach()
        tokens += mb.shape[0] * (mb.shape[1] - 1)
    if cp is not None:
        cp.sum_shares(loss_sum)
    return loss_sum / n, tokens


def train_step(model: nn.Module, micro_batches: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, prec: Precision, *, grad_clip: float,
               poison: bool = False,
               grad_sync: Optional[Callable[[list[torch.Tensor]], None]] = None,
               cp: Optional["ContextParallel"] = None) -> StepResult:
    """Forward/backward over ``micro_batches`` (each [b, T+1] int64 on the model's device), then one
    optimizer + scheduler step. ``grad_clip`` 0 disables clipping (the norm is still measured).
    ``poison`` multiplies the loss by NaN (test-only fault injection ``runtime.fault=nan@N``).
    ``grad_sync`` (params) averages the gradients across ranks when the model is not wrapped in DDP.
    ``cp``: context parallelism (nsa/train/cp.py), None or size 1 without."""
    mean_loss, tokens = forward_backward(model, micro_batches, prec, poison=poison, cp=cp)
    if grad_sync is not None:        # data parallel without DDP (the CUDA-graph step): average the grads
        grad_sync(_params(optimizer))
    prec.scaler.unscale_(optimizer)                          # no-op unless fp16
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    # after DDP's all-reduce every rank holds the averaged grads, so this norm is the global one
    grad_norm = torch.nn.utils.clip_grad_norm_(_params(optimizer), max_norm)
    if hasattr(grad_norm, "full_tensor"):    # FSDP2 (sharded grads): a replicated DTensor, no communication
        grad_norm = grad_norm.full_tensor()
    grad_norm = grad_norm.float()
    finite = torch.isfinite(mean_loss) & torch.isfinite(grad_norm)
    _optimizer_step(optimizer, finite)
    prec.scaler.update()                                     # fp16: back off on overflow (sync-free)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=mean_loss, grad_norm=grad_norm, finite=finite, tokens=tokens)


@torch.no_grad()
def eval_loss(model: nn.Module, batches: Iterable[torch.Tensor], prec: Precision,
              cp: Optional["ContextParallel"] = None) -> torch.Tensor:
    """Mean token CE over ``batches`` (device tensor; NaN if there were none). Model left in train mode.
    ``cp``: every rank of the CP group evaluates the same batches, each its share (summed at the end)."""
    was_training = model.training
    model.eval()
    total, count = None, 0
    try:
        for b in batches:
            loss = lm_loss(_unwrap_ddp(model), b, prec, cp)      # no DDP forward: no grad sync needed
            total = loss if total is None else total + loss
            count += 1
    finally:
        model.train(was_training)
    if total is None:
        return torch.tensor(float("nan"))
    if cp is not None:
        cp.sum_shares(total)
    return total / count
