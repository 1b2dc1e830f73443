"""Process-wide runtime fallbacks: the counters telemetry reads, and the one registry of refused paths.

A leaf module: the dispatcher, the planner (nsa/ops/plan.py) and the kernels all record here without
importing each other. A path that failed on a device (a Gluon kernel that did not build, a flash-attn
entry that raised, a dense backend that refused a shape) is refused with a reason; the planner reads
the refusals and plans that path away from then on. `generation()` changes with every refusal, so a
cached plan keyed on it is never stale.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_fallbacks: dict[str, int] = {}
_refused: dict[tuple, str] = {}   # (path, *key) -> why; key: the device and what else the path depends on
_generation = [0]


def count_fallback(name: str) -> None:
    """Increment the global runtime-fallback counter `name` (e.g. "triton->torch")."""
    with _lock:
        _fallbacks[name] = _fallbacks.get(name, 0) + 1


def fallback_counts() -> dict[str, int]:
    """Copy of the global fallback counters."""
    with _lock:
        return dict(_fallbacks)


def reset_fallback_counts() -> None:
    with _lock:
        _fallbacks.clear()


def refuse(path: str, key: tuple, why: str) -> None:
    """Path `path` (e.g. "gluon_tile", "win_flash") failed for key (device, ...): planned away from now on."""
    with _lock:
        _refused[(path, *key)] = why
        _generation[0] += 1


def refused(path: str, key: tuple) -> str | None:
    """Why `path` was refused for key, or None (a lock-free dict read: traceable, no sync)."""
    return _refused.get((path, *key))


def generation() -> int:
    """Changes with every refusal (the planner's cache key)."""
    return _generation[0]


def refusals() -> dict[tuple, str]:
    """Copy of every refusal, (path, *key) -> why."""
    with _lock:
        return dict(_refused)


def reset_refusals() -> None:
    """Forget every refusal (tests)."""
    with _lock:
        _refused.clear()
        _generation[0] += 1
