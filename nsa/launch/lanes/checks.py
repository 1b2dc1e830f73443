"""A lane's own checks, run after it trained:

    repeat_check(run_a, run_b)        the deterministic lane: the two runs' losses, step by step (training.csv)
    prefill_check(run_dir, cfg)       the prefill lane: on the final model, batched prefill vs token-by-token
                                      cached decode, max |logit difference| against a bound from the dtype

Each returns a plain dict with ``ok`` and ``error`` (one line, empty when ok) for the lane's record.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, Optional

# fp32: the bound of the model-level decode test (tests/test_decode.py, atol = rtol = 1e-4) relative to the
# largest logit; bf16/fp16 autocast and fp32 matmuls in TF32 on CUDA (runtime.tf32, 10-bit mantissa): 16 units
# of that rounding (prefill and decode run different kernel shapes, so their roundings differ; a wrong cache
# or mask is off by far more, O(1)). At the prod_50k shape (2 layers, T=1024, random init) the prefill/decode
# gap stays well inside these bounds in fp32+TF32, bf16 and fp16 (logits up to about 3).
FP32_REL_BOUND = 1e-4
HALF_EPS_UNITS = 16
PREFILL_TOKENS = 1024      # cap on the checked sequence: past the production window (512) and selection span


def loss_curve(run_dir: Path) -> dict[int, float]:
    """{step: loss} from a run's training.csv (log_every=1: each row is one step's loss)."""
    out: dict[int, float] = {}
    path = Path(run_dir) / "training.csv"
    if not path.is_file():
        return out
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            try:
                out[int(float(row["step"]))] = float(row["loss"])
            except (KeyError, TypeError, ValueError):
                continue
    return out


def repeat_check(run_a: Path, run_b: Path) -> dict[str, Any]:
    """Largest |loss difference| per step of two runs of one config; ok only when every step agrees
    exactly (torch.use_deterministic_algorithms promises bitwise repeatable kernels)."""
    a, b = loss_curve(run_a), loss_curve(run_b)
    steps = sorted(set(a) & set(b))
    diffs = {s: abs(a[s] - b[s]) if math.isfinite(a[s]) and math.isfinite(b[s]) else math.inf for s in steps}
    worst = max(diffs, key=diffs.get) if diffs else None
    rec = {"check": "repeat", "steps": len(steps), "max_abs_diff": diffs[worst] if diffs else None,
           "worst_step": worst, "per_step": [[s, diffs[s]] for s in steps], "run_b": str(run_b)}
    if not steps:
        rec.update(ok=False, error="repeat check: no common logged steps in the two runs' training.csv")
    elif len(steps) != len(a) or len(steps) != len(b):
        rec.update(ok=False, error=f"repeat check: the runs logged different steps ({len(a)} vs {len(b)})")
    elif diffs[worst] != 0.0:
        rec.update(ok=False, error=f"repeat check: the two runs differ by {diffs[worst]:.3g} in loss at step "
                                   f"{worst} (deterministic algorithms on: expected 0)")
    else:
        rec.update(ok=True, error="")
    return rec


TF32_EPS = 2.0 ** -10


def prefill_bound(dtype_name: str, scale: float, tf32: bool = False) -> float:
    """Largest allowed |logit difference| for logits up to ``scale`` in ``dtype_name`` (fp32/bf16/fp16);
    ``tf32``: fp32 matmuls run in TF32 (CUDA with runtime.tf32)."""
    import torch
    if dtype_name == "fp32":
        rel = HALF_EPS_UNITS * TF32_EPS if tf32 else FP32_REL_BOUND
    else:
        rel = HALF_EPS_UNITS * torch.finfo({"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]).eps
    return rel * max(1.0, scale)


def prefill_check(run_dir: str, cfg_dict: dict[str, Any], device: Optional[str] = None) -> dict[str, Any]:
    """Load the lane's final checkpoint and compare batched prefill logits with token-by-token cached
    decode logits over one sequence (B=2, T=min(seq_len, PREFILL_TOKENS)), under the lane's precision."""
    import torch

    from nsa.config import config_from_dict
    from nsa.model import TinyLM
    from nsa.train.checkpoint import load_checkpoint, load_model_weights
    from nsa.train.precision import precision_from_config
    cfg = config_from_dict(cfg_dict)
    dev = torch.device(device or ("cuda" if cfg.runtime.use_gpu and torch.cuda.is_available() else "cpu"))
    rec: dict[str, Any] = {"check": "prefill", "device": str(dev), "dtype": cfg.runtime.precision}
    try:
        state = load_checkpoint(run_dir)
        model = TinyLM.from_config(cfg.model, cfg.nsa)
        load_model_weights(model, state)
        model = model.to(dev).eval()
        prec = precision_from_config(cfg.runtime, dev)
        T = min(cfg.train.seq_len, PREFILL_TOKENS)
        gen = torch.Generator().manual_seed(cfg.runtime.seed)
        ids = torch.randint(0, cfg.model.vocab, (2, T), generator=gen).to(dev)
        with torch.no_grad(), prec.autocast():
            full, _ = model.prefill(ids)                                       # [2, T, vocab] in one call
            first, caches = model.prefill(ids[:, :1], capacity=T)
            steps = [first] + [model.decode_step(ids[:, t:t + 1], caches) for t in range(1, T)]
            step = torch.cat(steps, 1)
        full, step = full.float(), step.float()
        diff = (full - step).abs().max().item()
        scale = full.abs().max().item()
        bound = prefill_bound(cfg.runtime.precision, scale, tf32=dev.type == "cuda" and cfg.runtime.tf32)
        rec.update(tokens=T, max_abs_diff=diff, max_abs_logit=scale, bound=bound, ok=diff <= bound)
        rec["error"] = "" if rec["ok"] else (f"prefill check: batched prefill and cached decode logits differ by "
                                             f"{diff:.3g} > bound {bound:.3g} ({cfg.runtime.precision}, T={T})")
    except Exception as e:  # noqa: BLE001 - a check that cannot run fails the lane with its reason
        rec.update(ok=False, error=f"prefill check could not run: {type(e).__name__}: {str(e)[:300]}")
    return rec


def run_prefill_check(run_dir: Path, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """prefill_check where the lane trained: in this process on CPU, as a one-GPU Ray task on GPUs
    (the lane's worker group has released its GPU by now)."""
    rt = cfg_dict["runtime"]
    if not rt["use_gpu"]:
        return prefill_check(str(run_dir), cfg_dict, "cpu")
    import ray
    task = ray.remote(num_gpus=min(1.0, rt["gpus_per_worker"]), num_cpus=0.01)(prefill_check)
    return ray.get(task.remote(str(run_dir), cfg_dict, None))
