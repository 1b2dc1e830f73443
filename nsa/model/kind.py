"""Which attention a model or checkpoint holds ("nsa" or "dense", config field model.attention).

A checkpoint records it in its config (``state["config"]["model"]["attention"]``; checkpoints written
before the field existed are NSA). Loading weights into a model of the other kind is refused with one
line naming both, instead of a strict load_state_dict listing dozens of missing keys.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from nsa.train.checkpoint import CheckpointError

ATTENTION_KINDS = ("nsa", "dense")


class AttentionKindError(CheckpointError):
    """A checkpoint of one attention kind was loaded into a model of the other."""


def checkpoint_kind(state: Mapping[str, Any]) -> str:
    """model.attention of a checkpoint state dict (its stored config); "nsa" when not recorded."""
    cfg = state.get("config") or {}
    model = (cfg.get("model") or {}) if isinstance(cfg, Mapping) else {}
    return str(model.get("attention", "nsa"))


def model_kind(model: torch.nn.Module) -> str:
    """model.attention of a (possibly DDP-wrapped) TinyLM; "nsa" for models that do not say."""
    inner = getattr(model, "module", model)
    return str(getattr(inner, "attention", "nsa"))


def check_attention_kind(model: torch.nn.Module, state: Mapping[str, Any], where: str = "checkpoint") -> None:
    """Raise AttentionKindError (one line, both kinds named) when `state` holds the other kind."""
    have, want = checkpoint_kind(state), model_kind(model)
    if have != want:
        raise AttentionKindError(
            f"{where} holds a model.attention={have!r} model but this model is model.attention={want!r}: "
            f"build it with model.attention={have} (or load a {want} checkpoint)")
