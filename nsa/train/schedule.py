"""AdamW with decoupled weight decay on matrices only, and warmup + cosine counted in optimizer steps.

The schedule is a ``LambdaLR`` stepped once per *optimizer* step (not per micro-batch), so changing
``train.accumulate`` does not change the schedule's shape. With ``LambdaLR``'s convention the factor
used by optimizer step k (1-based) is ``lr_factor(k - 1)``:
  warmup:  k = 1..W          factor = k / W                      (never exactly 0: step 1 learns)
  cosine:  k = W+1..total    factor = min + (1 - min) * 0.5 * (1 + cos(pi * (k - W) / (total - W)))
so the last step (k = total) runs at exactly ``min_lr_ratio * lr``.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nsa.config import TrainConfig


def lr_factor(step0: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the base lr for the optimizer step with 0-based index ``step0``."""
    k = step0 + 1
    if warmup_steps > 0 and k <= warmup_steps:
        return k / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (k - warmup_steps) / span))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay 2-D+ weights of non-embedding modules; never decay norms, biases or embeddings.

    Shared (tied) parameters are counted once; an embedding tied to the LM head is not decayed.
    """
    no_decay_ids: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if isinstance(module, nn.Embedding) or p.ndim < 2:
                no_decay_ids.add(id(p))
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if id(p) in no_decay_ids else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, train_cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW from nsa.config.TrainConfig (lr, beta1, beta2, weight_decay).

    ``fused=True`` (CPU and CUDA) matters beyond speed: the fused kernel reads ``optimizer.found_inf``
    and skips the update on device, which is how the step skips non-finite updates without a host
    sync (see nsa/train/step.py). Falls back to the foreach implementation where fused is missing.
    """
    groups = param_groups(model, train_cfg.weight_decay)
    kw = dict(lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=1e-8)
    try:
        return torch.optim.AdamW(groups, fused=True, **kw)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, foreach=True, **kw)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine in optimizer steps. The lambda is a plain function of module scope values so the
    scheduler's state_dict holds only numbers (checkpoints load with weights_only=True)."""
    w, total, floor = int(train_cfg.warmup_steps), int(train_cfg.steps), float(train_cfg.min_lr_ratio)

    def fn(step0: int) -> float:
        return lr_factor(step0, w, total, floor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
