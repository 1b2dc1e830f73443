"""Input factories and error metrics shared by the ops tests, the Triton tests and benchmarks."""
from __future__ import annotations

import torch

from .common import num_cmp_tokens

INPUT_NAMES = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def make_inputs(B: int, T: int, HQ: int, H: int, dk: int, dv: int, *, l: int, d: int,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                seed: int = 0, q_scale: float = 1.0, requires_grad: bool = False) -> list[torch.Tensor]:
    """Random [q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates] with NSA shapes for T tokens.

    Values are drawn in fp32 from a seeded CPU generator, then cast, so the same seed gives the
    same (rounded) inputs for every dtype/device. Gates are uniform in (0, 1).
    """
    gen = torch.Generator().manual_seed(seed)
    N = num_cmp_tokens(T, l, d)
    shapes = [(B, T, HQ, dk), (B, N, H, dk), (B, N, H, dv), (B, T, H, dk), (B, T, H, dv),
              (B, T, H, dk), (B, T, H, dv)]
    xs = [torch.randn(s, generator=gen) for s in shapes]
    xs[0] = xs[0] * q_scale
    xs.append(torch.rand(B, T, HQ, 3, generator=gen))
    out = [x.to(device=device, dtype=dtype) for x in xs]
    if requires_grad:
        out = [x.requires_grad_() for x in out]
    return out


def clone_inputs(xs: list[torch.Tensor], dtype: torch.dtype | None = None,
                 requires_grad: bool = True) -> list[torch.Tensor]:
    """Detached copies (optionally cast) that are fresh autograd leaves."""
    return [x.detach().to(dtype or x.dtype).clone().requires_grad_(requires_grad) for x in xs]


def rel_rms(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref||_2 / ||ref||_2 in fp64 (0 when both are 0). Host sync: tests only."""
    a64, r64 = a.detach().double(), ref.detach().double()
    den = r64.norm().item()  # sync-ok: test/bench metric
    num = (a64 - r64).norm().item()  # sync-ok: test/bench metric
    return num / den if den > 0 else num


def lowp_attention_error(dtype: torch.dtype, B: int = 1, T: int = 128, HQ: int = 4, H: int = 2,
                         dk: int = 32, dv: int = 32, seed: int = 0) -> tuple[float, float]:
    """(output, gradient) relative RMS error of a plain causal attention computed in `dtype` the
    way eager torch does (matmul in dtype, softmax in fp32), against fp64. The noise floor that
    low-precision parity bounds are derived from.
    """
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, dd, generator=gen) for h, dd in ((HQ, dk), (H, dk), (H, dv)))
    go = torch.randn(B, T, HQ, dv, generator=gen)
    outs, grads = [], []
    for dt in (torch.float64, dtype):
        qq, kk, vv = (x.to(dt).requires_grad_() for x in (q, k, v))
        G = HQ // H
        kr, vr = kk.repeat_interleave(G, 2), vv.repeat_interleave(G, 2)
        logits = torch.einsum("bthk,bshk->bhts", qq, kr).float() * dk ** -0.5
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        prob = logits.masked_fill(~mask, float("-inf")).softmax(-1).to(dt)
        o = torch.einsum("bhts,bshv->bthv", prob, vr)
        o.backward(go.to(dt))
        outs.append(o)
        grads.append([qq.grad, kk.grad, vv.grad])
    out_err = rel_rms(outs[1], outs[0])
    grad_err = max(rel_rms(a, b) for a, b in zip(grads[1], grads[0]))
    return out_err, grad_err


def grads(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """.grad of each leaf, zeros where autograd left None (e.g. empty k_cmp when T < l)."""
    return [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]


def decode_views(xs: list[torch.Tensor], t: int, tq: int, w: int,
                 l: int, d: int) -> tuple[list[torch.Tensor], int, int]:
    """Cut full-sequence inputs into what nsa_decode sees for queries t .. t+tq-1.

    Returns ([q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates], pos0, win_pos0) with the window
    buffer holding only the last keys the first query needs (win_pos0 = max(0, t - w + 1)).
    """
    q, kc, vc, ks, vs, kw, vw, g = xs
    S = t + tq
    n = num_cmp_tokens(S, l, d)
    w0 = max(0, t - w + 1)
    return [q[:, t:S], kc[:, :n], vc[:, :n], ks[:, :S], vs[:, :S], kw[:, w0:S], vw[:, w0:S],
            g[:, t:S]], t, w0
