"""Peer NSA implementations timed on the same shapes as ours (only those importable on this machine).

fla-core (`fla.ops.nsa.parallel_nsa`, pip package `fla-core`): compression + selection (+ optional sliding
window), mean-pooled compression with block = l_sel, G = HQ/H a power of two >= 16. On a GPU machine without
network, carry its wheel (and einops) as the device README explains, e.g. `.whl/fla_core-*.whl`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def fla_available() -> tuple[bool, str]:
    try:
        from fla.ops.nsa import parallel_nsa  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not timed"
        return False, f"{type(exc).__name__}: {str(exc)[:120]}"
    import fla
    return True, f"fla-core {getattr(fla, '__version__', '?')}"


def time_fla(B: int, T: int, HQ: int, H: int, dk: int, dv: int, n_sel: int, l_sel: int,
             cuda_time: Callable[..., float], warmup: int, iters: int, window: int = 0) -> dict[str, Any]:
    """fwd and fwd+bwd ms of fla's parallel_nsa (compression + selection; + window if window > 0)."""
    ok, why = fla_available()
    if not ok:
        return {"available": False, "why": why}
    from fla.ops.nsa import parallel_nsa
    G = HQ // H
    if G < 16 or G & (G - 1):
        return {"available": True, "version": why, "skipped": f"G={G}: fla needs a power of two >= 16"}
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, HQ, dk, device=dev, dtype=dt, generator=gen, requires_grad=True)
    k = torch.randn(B, T, H, dk, device=dev, dtype=dt, generator=gen, requires_grad=True)
    v = torch.randn(B, T, H, dv, device=dev, dtype=dt, generator=gen, requires_grad=True)
    gates = [torch.rand(B, T, HQ, device=dev, dtype=dt, generator=gen).requires_grad_() for _ in range(3)]
    g_swa = gates[2] if window > 0 else None

    def fwd():
        with torch.no_grad():
            return parallel_nsa(q, k, v, gates[0], gates[1], g_swa, block_counts=n_sel, block_size=l_sel,
                                window_size=window)

    do = torch.randn(B, T, HQ, dv, device=dev, dtype=dt, generator=gen)

    def fwd_bwd():
        o = parallel_nsa(q, k, v, gates[0], gates[1], g_swa, block_counts=n_sel, block_size=l_sel,
                         window_size=window)
        o.backward(do)

    try:
        return {"available": True, "version": why, "window": window,
                "fwd_ms": cuda_time(fwd, warmup, iters), "fwd_bwd_ms": cuda_time(fwd_bwd, warmup, iters)}
    except Exception as exc:  # noqa: BLE001 - a peer failing must not lose our own numbers
        return {"available": True, "version": why, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
