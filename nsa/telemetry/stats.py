"""Gate / selection health statistics, host transfer, rolling percentiles and memory.

``gate_stats``/``selection_stats``/``layer_stats`` return 0-d tensors on the input's device and never
synchronise with the host: the loop may compute them every step for free (they are queued kernels)
and call :func:`to_host` — the one deliberate sync, a single stacked transfer — every N steps.

Gate health thresholds users watch (seeds 001/004): entropy mean > 0.3-0.5 nats (uniform = ln 3 =
1.0986), max-gate mean < 0.9, collapse fraction < 0.1-0.2.
"""
from __future__ import annotations

import bisect
import math
import os
from collections import deque
from typing import Any, Mapping

import torch

GATE_BRANCHES = ("cmp", "slc", "win")
MIB = 1024 * 1024


def gate_stats(gates: torch.Tensor, *, collapse_threshold: float = 0.9,
               eps: float = 1e-12) -> dict[str, torch.Tensor]:
    """Health of the 3-way branch gates ``[..., 3]`` (cmp, slc, win; sigmoid outputs).

    Each (token, head) gate triple is normalised to a distribution ``p``. Returns 0-d float32
    tensors: ``entropy`` (mean of -sum p ln p, nats), ``max_gate`` (mean of max p), ``collapse_frac``
    (share of (token, head) with max p > ``collapse_threshold``), ``share_cmp|slc|win`` (mean p per
    branch) and ``raw_mean`` (mean raw gate: catches all gates sinking to 0 together, which the
    normalised numbers hide). Empty input gives NaN.
    """
    if not isinstance(gates, torch.Tensor):
        raise ValueError(f"gates must be a torch.Tensor [..., 3], got {type(gates).__name__}")
    if gates.ndim < 1 or gates.shape[-1] != 3:
        raise ValueError(f"gates must have last dimension 3 (cmp, slc, win), got shape {tuple(gates.shape)}")
    if not 0.0 <= collapse_threshold < 1.0:
        raise ValueError(f"collapse_threshold must be in [0, 1), got {collapse_threshold!r}")
    g = gates.detach().float().reshape(-1, 3)                       # [N, 3], N = tokens * heads
    p = g / g.sum(dim=-1, keepdim=True).clamp_min(eps)              # [N, 3] normalised
    entropy = -(p * torch.log(p.clamp_min(eps))).sum(dim=-1)        # [N]
    p_max = p.amax(dim=-1)                                          # [N]
    shares = p.mean(dim=0)                                          # [3]
    out = {
        "entropy": entropy.mean(),
        "max_gate": p_max.mean(),
        "collapse_frac": (p_max > collapse_threshold).float().mean(),
    }
    for i, name in enumerate(GATE_BRANCHES):
        out[f"share_{name}"] = shares[i]
    out["raw_mean"] = g.mean()
    return out


def _query_blocks(positions: torch.Tensor | None, B: int, T: int, l_sel: int,
                  device: torch.device) -> torch.Tensor:
    """Selection block of each query, shaped to broadcast against [B, T, H, n_sel]."""
    if positions is None:
        pos = torch.arange(T, device=device)                        # [T]
    else:
        pos = torch.as_tensor(positions, device=device)
        if pos.dtype.is_floating_point or pos.shape not in ((T,), (B, T)):
            raise ValueError(f"positions must be an integer tensor [T] or [B, T] with T={T}, B={B}; "
                             f"got dtype {pos.dtype}, shape {tuple(pos.shape)}")
    pos = pos.to(torch.int64)
    qb = torch.div(pos, l_sel, rounding_mode="floor")
    return qb.reshape(-1, T, 1, 1)                                  # [B|1, T, 1, 1]


def selection_stats(block_idx: torch.Tensor, *, l_sel: int,
                    positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Statistics of selected blocks ``block_idx [B, T, H, n_sel]`` (-1 = unused slot).

    ``positions``: absolute query positions ``[T]`` or ``[B, T]`` (default ``0..T-1``, prefill).
    Returns 0-d float32 tensors: ``valid_slots`` (mean number of used slots per (token, head)),
    ``fill_frac`` (used slots / n_sel), ``mean_dist_blocks`` (mean of query block - selected block
    over used slots) and ``free_frac`` (share of used slots that are not forced: not block 0, not
    the query's block nor the one before it — the part chosen by score). NaN if no slot is used.
    """
    if not isinstance(block_idx, torch.Tensor) or block_idx.ndim != 4:
        shape = tuple(block_idx.shape) if isinstance(block_idx, torch.Tensor) else type(block_idx).__name__
        raise ValueError(f"block_idx must be a tensor [B, T, H, n_sel], got {shape}")
    if block_idx.dtype.is_floating_point or block_idx.dtype == torch.bool:
        raise ValueError(f"block_idx must be an integer tensor, got {block_idx.dtype}")
    if int(l_sel) <= 0:
        raise ValueError(f"l_sel must be a positive int, got {l_sel!r}")
    B, T, _, _ = block_idx.shape
    idx = block_idx.detach().to(torch.int64)
    qb = _query_blocks(positions, B, T, int(l_sel), idx.device)     # [B|1, T, 1, 1]
    valid = idx >= 0                                                # [B, T, H, n_sel]
    forced = (idx == 0) | (idx == qb) | (idx == qb - 1)
    n_valid = valid.sum().float()
    denom = n_valid.clamp_min(1.0)
    nan = torch.full((), math.nan, device=idx.device)
    dist = torch.where(valid, qb - idx, torch.zeros_like(idx)).float()
    return {
        "valid_slots": valid.sum(dim=-1).float().mean(),
        "fill_frac": valid.float().mean(),
        "mean_dist_blocks": torch.where(n_valid > 0, dist.sum() / denom, nan),
        "free_frac": torch.where(n_valid > 0, (valid & ~forced).sum().float() / denom, nan),
    }


def layer_stats(layers: Any, prefix: str = "", *, l_sel: int | None = None,
                collapse_threshold: float = 0.9,
                positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Flat ``{f"{prefix}gate/L{i}/entropy": t, f"{prefix}sel/L{i}/free_frac": t, ...}``.

    ``layers``: an iterable of layers exposing ``last_gates`` / ``last_block_idx`` (None allowed:
    skipped), or a model with ``nsa_layers()``. ``l_sel`` defaults to each layer's ``l_sel``
    attribute. ``L{i}`` is the position in that list.
    """
    if hasattr(layers, "nsa_layers"):
        layers = layers.nsa_layers()
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        gates = getattr(layer, "last_gates", None)
        if gates is not None:
            for k, v in gate_stats(gates, collapse_threshold=collapse_threshold).items():
                out[f"{prefix}gate/L{i}/{k}"] = v
        block_idx = getattr(layer, "last_block_idx", None)
        if block_idx is not None:
            layer_l_sel = l_sel if l_sel is not None else getattr(layer, "l_sel", None)
            if layer_l_sel is None:
                raise ValueError(f"layer {i} has last_block_idx but no l_sel attribute; pass l_sel=")
            for k, v in selection_stats(block_idx, l_sel=layer_l_sel, positions=positions).items():
                out[f"{prefix}sel/L{i}/{k}"] = v
    return out


def to_host(stats: Mapping[str, Any]) -> dict[str, float]:
    """Move a dict of 0-d tensors (and plain numbers) to Python floats with one transfer per device.

    This is the deliberate host sync of the telemetry path; call it every N steps, not every step.
    """
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in stats.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"to_host: {key!r} must be a 0-d (one-element) tensor, "
                                 f"got shape {tuple(value.shape)}")
            dtype = torch.float32 if value.device.type == "mps" else torch.float64
            by_device.setdefault(value.device, []).append((key, value.detach().reshape(()).to(dtype)))
        else:
            out[key] = float(value)
    for items in by_device.values():
        values = torch.stack([t for _, t in items]).cpu().tolist()  # sync-ok: the one stats transfer
        out.update({k: float(v) for (k, _), v in zip(items, values)})
    return {k: out[k] for k in stats}  # keep the caller's key order


class RollingPercentiles:
    """Percentiles of the last ``window`` host floats (step/fetch times). Pure Python.

    ``add`` is O(window) (sorted insert); the percentiles are O(1). Empty -> NaN.
    """

    def __init__(self, window: int = 100) -> None:
        if int(window) <= 0:
            raise ValueError(f"window must be a positive int, got {window!r}")
        self.window = int(window)
        self._values: deque[float] = deque()
        self._sorted: list[float] = []
        self.count = 0  # total values ever added

    def add(self, x: float) -> None:
        x = float(x)
        if len(self._values) == self.window:
            old = self._values.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._values.append(x)
        bisect.insort(self._sorted, x)
        self.count += 1

    def percentile(self, q: float) -> float:
        """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default method)."""
        if not 0.0 <= q <= 100.0:
            raise ValueError(f"q must be in [0, 100], got {q!r}")
        data = self._sorted
        if not data:
            return math.nan
        pos = (len(data) - 1) * q / 100.0
        lo = math.floor(pos)
        hi = min(lo + 1, len(data) - 1)
        return data[lo] + (data[hi] - data[lo]) * (pos - lo)

    @property
    def p50(self) -> float:
        return self.percentile(50.0)

    @property
    def p95(self) -> float:
        return self.percentile(95.0)

    @property
    def mean(self) -> float:
        return sum(self._values) / len(self._values) if self._values else math.nan

    def __len__(self) -> int:
        return len(self._values)


def _rss_mib() -> float:
    """Current resident set size in MiB: psutil, else /proc, else the peak from getrusage."""
    try:
        import psutil
        return psutil.Process().memory_info().rss / MIB
    except ImportError:
        pass
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB
    except (OSError, ValueError, IndexError):
        pass
    import resource
    import sys
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def memory_mib(device: torch.device | str | None = None) -> dict[str, float]:
    """Memory in MiB (2**20 bytes, like the old heartbeat's ``gpu_mem_alloc``).

    CUDA devices: ``cuda_alloc_mib``, ``cuda_reserved_mib``, ``cuda_max_alloc_mib`` (allocator
    counters; no device sync). Always ``rss_mib`` (process). ``mem_mib`` is the headline number for
    training.csv: CUDA allocated on a GPU, else RSS.
    """
    out: dict[str, float] = {}
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        out["cuda_alloc_mib"] = torch.cuda.memory_allocated(dev) / MIB
        out["cuda_reserved_mib"] = torch.cuda.memory_reserved(dev) / MIB
        out["cuda_max_alloc_mib"] = torch.cuda.max_memory_allocated(dev) / MIB
        out["mem_mib"] = out["cuda_alloc_mib"]
    out["rss_mib"] = _rss_mib()
    out.setdefault("mem_mib", out["rss_mib"])
    return out


def mean_over_layers(stats: Mapping[str, float], metric: str, kind: str = "gate") -> float:
    """Mean of ``{kind}/L*/{metric}`` host values (e.g. one entropy number for a console line)."""
    vals = [v for k, v in stats.items()
            if k.split("/")[-1] == metric and f"{kind}/L" in k and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else math.nan

