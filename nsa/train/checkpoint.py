"""Self-describing checkpoints (DESIGN principle 6), loadable with ``torch.load(weights_only=True)``.

A checkpoint is a directory holding ``checkpoint.pt`` and ``meta.json``:

    checkpoint.pt   {"format", "step", "model", "optimizer", "scheduler", "scaler", "rng", "data",
                     "config", "metrics"}  -- tensors, numbers, strings, lists/tuples/dicts only
    meta.json       {"format", "step", "created"}  (human-readable; lets tools pick the latest cheaply)

The Ray loop writes it into a temp dir and hands it to ``ray.train.report`` which persists it as
``<run dir>/checkpoint_<step:08d>/``. Nothing here imports Ray.

Rules: never overwrite an existing checkpoint (``save_checkpoint`` raises ``FileExistsError``); a
corrupt or truncated file raises ``CheckpointError`` naming the file.
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

CKPT_FILE = "checkpoint.pt"
META_FILE = "meta.json"
FORMAT = 1
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "scheduler", "scaler", "rng", "data", "config")
_DIR_RE = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible; the message names the file."""


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


# ------------------------------------------------------------------------------------------ RNG state
def capture_rng() -> dict[str, Any]:
    """torch (CPU + every CUDA device), numpy and Python RNG states as weights_only-safe values."""
    np_state = np.random.get_state()
    ver, keys, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": ver, "keys": list(keys), "gauss": gauss},
    }


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = rng["python"]
    random.setstate((p["version"], tuple(p["keys"]), p["gauss"]))


# ------------------------------------------------------------------------------------------ save
def build_state(*, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                scaler: torch.amp.GradScaler, step: int, data: dict[str, int], config: dict[str, Any],
                metrics: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Collect everything needed to continue training. ``model`` must be the unwrapped module (no
    ``module.`` prefixes from DDP) so weights load into a plain TinyLM for inference."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return {
        "format": FORMAT,
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": capture_rng(),
        "data": {k: int(v) for k, v in data.items()},
        "config": config,
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }


def save_checkpoint(directory: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``directory/checkpoint.pt`` (+ meta.json). Refuses to overwrite."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    target = d / CKPT_FILE
    if target.exists():
        raise FileExistsError(f"refusing to overwrite existing checkpoint {target}")
    tmp = d / (CKPT_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, target)                    # atomic: readers never see a half-written file
    meta = {"format": state["format"], "step": state["step"], "created": time.time()}
    (d / META_FILE).write_text(json.dumps(meta))
    return target


# ------------------------------------------------------------------------------------------ find / load
def _step_of(d: Path) -> Optional[int]:
    meta = d / META_FILE
    if meta.is_file():
        try:
            return int(json.loads(meta.read_text())["step"])
        except (ValueError, KeyError, json.JSONDecodeError):
            pass
    m = _DIR_RE.match(d.name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint directory directly under ``run_dir``, ascending by step."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("checkpoint_") and (d / CKPT_FILE).exists():
            step = _step_of(d)
            if step is not None:
                out.append((step, d))
    return sorted(out)


def resolve_checkpoint_file(path: str | os.PathLike) -> Path:
    """A checkpoint file, a checkpoint dir, or a run dir (-> its latest checkpoint) -> the .pt file."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist")
    if (p / CKPT_FILE).is_file():
        return p / CKPT_FILE
    found = list_checkpoints(p)
    if found:
        return found[-1][1] / CKPT_FILE
    raise CheckpointError(f"no {CKPT_FILE} in {str(p)!r} and no checkpoint_* directories under it: "
                          "pass a run directory or a checkpoint directory")


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Load with ``weights_only=True``; raise CheckpointError naming the file if it is unreadable or
    lacks required keys. ``mmap=True`` is a cheap structural check (tensor bytes are not read)."""
    f = resolve_checkpoint_file(path)
    try:
        state = torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # zip/pickle/EOF/unpickling errors all mean the same thing to the user
        raise CheckpointError(f"checkpoint file {f} is corrupt or not a weights-only torch checkpoint "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {f} does not hold a dict (got {type(state).__name__})")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint file {f} lacks keys {missing}: not written by nsa.train")
    if state["format"] != FORMAT:
        raise CheckpointError(f"checkpoint file {f} has format {state['format']}, this code reads {FORMAT}")
    return state


def verify_checkpoint(path: str | os.PathLike) -> tuple[Path, int]:
    """Driver-side preflight: (file, step) if ``path`` resolves to a readable checkpoint."""
    f = resolve_checkpoint_file(path)
    state = load_checkpoint(f, mmap=True)
    return f, int(state["step"])


def load_model_weights(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load the checkpoint's model weights (strict) into an unwrapped model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    from nsa.model.kind import check_attention_kind  # nsa vs dense twin: one clear line, not key lists
    check_attention_kind(model, state)
    model.load_state_dict(state["model"], strict=True)


def restore_training_state(state: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler: Any, scaler: torch.amp.GradScaler, rng: bool = True) -> int:
    """Restore everything but the data position; returns the step the checkpoint was taken after."""
    load_model_weights(model, state)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    if rng:
        restore_rng(state["rng"])
    return int(state["step"])
