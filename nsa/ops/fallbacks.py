"""Process-wide runtime-fallback counters (e.g. "triton->torch"), read by telemetry.

A leaf module: the dispatcher and the kernels both count here without importing each other.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()
_fallbacks: dict[str, int] = {}


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
