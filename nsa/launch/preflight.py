"""Refusals that need numbers, before Ray starts (each one line naming the field and the fix):

- ``runtime.storage_root`` that refuses writes (a read-only mount): the run dir, MLflow store and shards
  under it would fail in a worker after Ray started.
- too little data: a rank whose share of the train tokens is under one batch produces no batch, in
  every attempt. The manifest knows the token count: fewer than ``workers x batch_size x (seq_len+1)``
  in all means some rank gets less than one batch.
- a passkey document (data.passkey_fraction > 0) longer than ``train.seq_len`` with the run's tokenizer.
- too little memory: a step's activations grow with ``batch_size x seq_len``; Ray's memory monitor kills an
  over-sized CPU run minutes later. The estimate (``train_bytes``) errs low rather than high: it refuses
  requests off by orders of magnitude (``train.seq_len=1048576`` on the CPU profile: ~100s of GiB), not
  runs near the limit.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

from nsa.launch.cli import UserError

# activations kept for backward, per token and layer, in units of model.dim elements: the norm inputs,
# q/k/v, the three NSA branch outputs and gates, the output projection, and the MLP's ffn_mult-wide
# hidden (input and activation)
ACT_PER_DIM = 16
OPT_BYTES_PER_PARAM = 16      # fp32 weights + grads + Adam's two moments
MEMORY_FRACTION = 0.9         # of the available memory a run may plan to use


def check_storage_root(cfg: Any) -> None:
    """``runtime.storage_root`` must take a file: create and delete one there (a read-only mount fails)."""
    root = cfg.runtime.storage_root
    if not root or not Path(root).expanduser().is_dir():
        return   # unset, or refused by nsa.launch.storage with its own line
    try:
        with tempfile.NamedTemporaryFile(dir=Path(root).expanduser(), prefix=".nsa-write-probe-"):
            pass
    except OSError as e:
        raise UserError(f"runtime.storage_root={root} is not writable ({e.strerror}): runs, checkpoints and "
                        "MLflow are written there; remount it read-write or set runtime.storage_root to a "
                        "writable directory") from None


def configured_workers(cfg: Any) -> Optional[int]:
    """Train workers the config alone decides: runtime.num_workers, or with -1 runtime.gpus // gpus_per_worker
    (UserError below one); None where only the cluster can tell (-1 without runtime.gpus)."""
    r = cfg.runtime
    if r.num_workers != -1:
        return r.num_workers
    if r.gpus is None:
        return None
    n = int(r.gpus // max(r.gpus_per_worker, 1e-9))
    if n < 1:
        raise UserError(f"runtime.gpus={r.gpus} is less than runtime.gpus_per_worker={r.gpus_per_worker:g}: "
                        "raise runtime.gpus")
    return n


def planned_workers(cfg: Any) -> int:
    """Train workers the launch will start, without asking Ray (at least 1)."""
    try:
        return max(1, configured_workers(cfg) or 1)
    except UserError:   # the launch refuses it with its own message
        return 1


def check_data_tokens(cfg: Any) -> None:
    """Refuse a run whose train shards hold fewer tokens than one batch per worker (manifest counts)."""
    from nsa.data.shards import read_manifest
    from nsa.data.sources import is_url
    d, t = cfg.data, cfg.train
    if d.source != "parquet" or is_url(d.path) or not Path(d.path).is_dir():
        return
    try:
        m = read_manifest(d.path)
    except ValueError:
        return        # check_data_path names an unreadable manifest
    if not m or m.get("token_counter", "byte") != d.tokenizer:
        return        # counts in another tokenizer's tokens say nothing about this one's
    try:   # + one end-of-document token per doc: an upper bound of the packed stream
        have = sum(int(e["tokens"]) + int(e["docs"]) for e in m["train"])
    except (KeyError, TypeError, ValueError):
        return
    w = planned_workers(cfg)
    need = w * t.batch_size * (t.seq_len + 1)
    if have < need:
        fits = have // (w * t.batch_size) - 1
        hint = f"lower train.seq_len to <= {fits}" if fits >= 1 else "lower train.batch_size"
        raise UserError(f"data.path={d.path} holds {have:,} train tokens (manifest.json), fewer than one batch per "
                        f"worker: {w} worker(s) x train.batch_size={t.batch_size} x (train.seq_len={t.seq_len} + 1) "
                        f"= {need:,}: {hint}, use fewer workers, or add data")


def param_count(cfg: Any) -> int:
    """Parameters of the configured model, built on the meta device (no memory)."""
    import torch
    from nsa.model import TinyLM
    with torch.device("meta"):
        model = TinyLM.from_config(cfg.model, cfg.nsa)
    return sum(p.numel() for p in model.parameters())


def train_bytes(cfg: Any, params: Optional[int] = None) -> tuple[int, int]:
    """(bytes one worker needs for a step, of which per token) for the configured model and batch."""
    m, t, r = cfg.model, cfg.train, cfg.runtime
    elem = 2 if r.precision in ("bf16", "fp16") else 4
    layers = 1 if m.grad_checkpointing else m.n_layers       # checkpointing keeps one layer's activations
    per_token = (layers * ACT_PER_DIM * m.dim + 2 * int(m.ffn_mult * m.dim)) * elem
    per_token += (m.n_layers * m.dim * elem if m.grad_checkpointing else 0)    # each layer's saved input
    per_token += 3 * 4 * m.vocab                                # logits, log-softmax and its grad (fp32)
    params = param_count(cfg) if params is None else params
    return OPT_BYTES_PER_PARAM * params + per_token * t.batch_size * t.seq_len, per_token


def check_memory(cfg: Any, free: Optional[int] = None) -> None:
    """Refuse a step that cannot fit this machine: CPU workers of a local instance (they all run here),
    or one GPU worker when this machine has the GPU. Clusters the driver cannot see are not checked."""
    import torch
    from nsa.train.limits import free_memory
    r, t = cfg.runtime, cfg.train
    if r.use_gpu:
        if not torch.cuda.is_available():
            return
        workers, where = 1, "one GPU"
        free = torch.cuda.get_device_properties(0).total_memory if free is None else free
    else:
        if r.ray_address:
            return
        workers, where = planned_workers(cfg), "this machine"
        free = free_memory(torch.device("cpu")) if free is None else free
    if not free:
        return
    per_worker, per_token = train_bytes(cfg)
    need = workers * per_worker
    if need <= MEMORY_FRACTION * free:
        return
    fixed = per_worker - per_token * t.batch_size * t.seq_len
    fits = int((MEMORY_FRACTION * free / workers - fixed) // max(1, per_token * t.batch_size))
    hint = f"use train.seq_len <= {fits}" if fits >= 1 else "use a smaller model"
    raise UserError(f"train.seq_len={t.seq_len} x train.batch_size={t.batch_size} needs about {need / 2**30:.1f} GiB "
                    f"for {workers} worker(s) on {where} ({per_token:,} bytes of activations per token and worker), "
                    f"more than {MEMORY_FRACTION:.0%} of its {free / 2**30:.1f} GiB available: {hint}, or lower "
                    "train.batch_size (train.accumulate keeps the tokens per step)")


def check_passkey(cfg: Any) -> None:
    """data.passkey_fraction > 0: one passkey document (its length depends on the tokenizer) must fit train.seq_len."""
    if cfg.data.passkey_fraction > 0:
        from nsa.data.passkey import seq_len_error
        from nsa.data.tokenizers import get_tokenizer
        err = seq_len_error(cfg.train.seq_len, get_tokenizer(cfg.data.tokenizer, tiktoken_path=cfg.data.tiktoken_path))
        if err:
            raise UserError(err)


def preflight(cfg: Any) -> None:
    """All of the above, in validate_inputs after the paths are absolute."""
    check_storage_root(cfg)
    check_passkey(cfg)
    check_data_tokens(cfg)
    check_memory(cfg)


__all__ = ["preflight", "check_storage_root", "check_passkey", "check_data_tokens", "check_memory", "train_bytes"]
