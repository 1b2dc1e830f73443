"""What a lane really changes: its config with every field that has no effect on the base's device
normalised, so that two lanes which would run the same experiment compare equal.

    eff, notes = effective_config(cfg, lane)      # {field: value}, {field: why it is normalised}
    reason = unmet_requirement(lane, base_cfg)    # None, or why the lane cannot run on this base

The rules follow the code paths they stand for: the kernel policy (nsa/ops/dispatch.py: "auto" is
triton on CUDA, torch elsewhere; triton on CPU falls back to torch), nsa/ops/flash.py (flash-attn
only on CUDA, and for the NSA model only on the branches the GPU presets' tuning.flash moves there),, the training loop (TF32, CUDA graphs and GPU counts
only mean something on GPUs; GradScaler settings only in fp16) and the dense twin (every nsa.* field
belongs to the sparse layer it replaces). Fields the grid pins per lane (run names, paths) never count.
"""
from __future__ import annotations

from typing import Any, Optional

from nsa.config import RunConfig
from nsa.launch.lanes.schema import PINNED, Lane, fmt_value

NO_EFFECT = "<no effect>"
GPU_ONLY = ("runtime.tf32", "runtime.cuda_graph", "runtime.cuda_graph_warmup", "runtime.gpus_per_worker",
            "logging.memory_snapshot_steps")
SCALER = ("runtime.scaler_init_scale", "runtime.scaler_growth_interval", "runtime.scaler_growth_factor",
          "runtime.scaler_backoff_factor")
NSA_LAYER = ("nsa.l", "nsa.d", "nsa.l_sel", "nsa.n_sel", "nsa.w", "nsa.backend", "nsa.flash_branches",
             "model.compression")


def flash_installed() -> Optional[str]:
    """The flash-attn backend importable in this process ("fa4"/"fa2"), else None."""
    from nsa.ops.flash import fa2_func, fa4_func
    return "fa4" if fa4_func() is not None else ("fa2" if fa2_func() is not None else None)


def gpu_flash_branches() -> bool:
    """Whether a GPU preset (nsa.ops.tuning) runs an NSA branch on flash-attn (tuning.flash not off)."""
    from nsa.ops.tuning import AMPERE, HOPPER
    return any(t.flash.win != "off" or t.flash.cmp != "off" for t in (HOPPER, AMPERE))


def preset_flash_branches() -> str:
    """The Hopper preset's tuning.flash as an nsa.flash_branches value (off, win, cmp, win+cmp)."""
    from nsa.ops.tuning import HOPPER
    on = [b for b in ("win", "cmp") if getattr(HOPPER.flash, b) != "off"]
    return "+".join(on) or "off"


def effective_config(cfg: RunConfig, lane: Lane) -> tuple[dict[str, Any], dict[str, str]]:
    """({field: effective value}, {field: why it has no effect or what it resolves to}) for ``cfg``."""
    eff = {k: v for k, v in cfg.flat().items() if k not in PINNED}
    notes: dict[str, str] = {}

    def set_(key: str, value: Any, why: str) -> None:
        if eff[key] != value:
            notes[key] = why
        eff[key] = value

    gpu = cfg.runtime.use_gpu
    if not gpu:
        for k in GPU_ONLY:
            set_(k, NO_EFFECT, "only used on GPUs")
        set_("nsa.allow_flash_attn", NO_EFFECT, "flash-attn needs CUDA")
        set_("nsa.flash_branches", NO_EFFECT, "flash-attn needs CUDA")
    if cfg.runtime.precision != "fp16":
        for k in SCALER:
            set_(k, NO_EFFECT, "GradScaler runs in fp16 only")
    if not cfg.runtime.cuda_graph:
        set_("runtime.cuda_graph_warmup", NO_EFFECT, "runtime.cuda_graph is off")
    if cfg.model.attention == "dense":
        for k in NSA_LAYER:
            set_(k, NO_EFFECT, "the dense twin has no NSA layer")
        if cfg.model.dense_backend != "auto":   # an explicit kernel: allow_flash_attn no longer chooses
            set_("nsa.allow_flash_attn", NO_EFFECT, f"model.dense_backend={cfg.model.dense_backend} picks the kernel")
    else:
        set_("model.dense_backend", NO_EFFECT, "only the dense twin (model.attention=dense) has dense layers")
        backend = cfg.nsa.backend
        if backend in ("auto", "triton"):
            # "auto" on CUDA is triton when its kernels load on the workers: assumed, as the policy would
            set_("nsa.backend", "triton" if gpu else "torch",
                 "auto is triton on CUDA" if gpu else f"{backend} resolves to torch without CUDA")
        if gpu and not cfg.nsa.allow_flash_attn:
            set_("nsa.flash_branches", NO_EFFECT, "nsa.allow_flash_attn=false")
        elif gpu and cfg.nsa.flash_branches == "preset":
            set_("nsa.flash_branches", preset_flash_branches(), "the GPU preset's tuning.flash")
        if not gpu_flash_branches() and cfg.nsa.flash_branches in ("preset", "off"):
            set_("nsa.allow_flash_attn", NO_EFFECT,
                 "the GPU presets run no NSA branch on flash-attn (nsa.ops.tuning FlashBranchTuning)")
        elif gpu and cfg.nsa.allow_flash_attn and flash_installed() is None:
            set_("nsa.allow_flash_attn", False, "no flash-attn package importable (pip install -e '.[flash]')")
    if (gpu and cfg.model.attention == "dense" and cfg.model.dense_backend == "auto" and cfg.nsa.allow_flash_attn
            and flash_installed() is None):
        set_("nsa.allow_flash_attn", False, "no flash-attn package importable (pip install -e '.[flash]')")
    eff["lane.repeat"], eff["lane.checks"] = lane.repeat, ",".join(lane.checks)
    return eff, notes


def unmet_requirement(lane: Lane, base_cfg: RunConfig) -> Optional[str]:
    """Why ``lane`` cannot run on this base (its ``requires:``), or None."""
    if "gpu" in lane.requires and not base_cfg.runtime.use_gpu:
        return "needs a GPU (the base profile trains on CPU: runtime.use_gpu=false)"
    if "flash_attn" in lane.requires:
        if not base_cfg.runtime.use_gpu:
            return "needs flash-attn, which runs on CUDA only (runtime.use_gpu=false)"
        if flash_installed() is None:
            return "needs flash-attn: no flash_attn package importable here (pip install -e '.[flash]')"
    return None


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a if a[k] != b.get(k))


def same_as(lane: Lane, notes: dict[str, str], raw: dict[str, Any], other: str,
            other_notes: Optional[dict[str, str]] = None) -> str:
    """Why ``lane`` equals lane ``other``: each of its overrides and what makes it a no-op here."""
    parts, other_notes = [], other_notes or {}
    for key in lane.overrides:
        val = fmt_value(raw.get(key))
        why = notes.get(key) or (f"{other}'s value: {other_notes[key]}" if key in other_notes else
                                 f"what {other} has too")
        parts.append(f"{key}={val} ({why})")
    return ", ".join(parts) or "no overrides"


def describe(eff: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k}={fmt_value(eff[k])}" for k in keys)
