"""The NSA op as torch.library custom ops, so torch.compile traces a whole NSA model (fullgraph).

    nsa::attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l, d, l_sel, n_sel, w, scale,
                   backend, tile, recompute, allow_flash, flash_branches) -> (o, block_idx)
    nsa::attention_backward(do, <the eight inputs>, <the same hyper-parameters>) -> eight grads

Both are opaque nodes in the traced graph; their implementations run nsa.ops.nsa_attention eagerly,
so the compiled model computes the eager op's numbers with whatever backend it resolves to (torch on
CPU, triton on CUDA). nsa_attention routes here only while torch.compile traces (the eager path pays
nothing for the custom-op dispatch); see traced_attention.

Backward recomputes the op's forward under autograd and differentiates it (torch.autograd.grad):
the op's residuals (per-branch log-sum-exp, selection inverses, external SDPA / flash-attn autograd
nodes) are not tensors the Triton autograd.Function hands out, so a custom op cannot keep them; on
the torch backend the eager op itself recomputes tiles in backward already. Cost: one extra op
forward per backward under torch.compile. Double backward is not supported.

The dispatcher runs custom-op kernels with autocast off (forward and backward alike, so the
recomputed forward is the one that made o; the inputs already carry the compute dtype) and with
autograd off, which the backward re-enables for its recomputation (_autograd_on).
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from .common import NSAParams, safe_scale, validate_inputs
from .dispatch import _check_requested
from .eager import eager_attention

_GRAD_INPUTS = ("q", "k_cmp", "v_cmp", "k_slc", "v_slc", "k_win", "v_win", "gates")


def _eager(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l, d, l_sel, n_sel, w, scale, backend,
           tile, recompute, allow_flash, flash_branches):
    """The eager op, positional hyper-parameters as in the schema."""
    return eager_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d, l_sel=l_sel,
                         n_sel=n_sel, w=w, scale=scale, backend=backend, tile=tile, recompute=recompute,
                         allow_flash=allow_flash, flash_branches=flash_branches)


def _autograd_on():
    """Undo the dispatcher's autograd exclusion around a custom-op kernel (torch.enable_grad alone
    does not), so the backward kernel can record and differentiate the eager op. No public API does
    this in torch 2.13; tests/test_compile_op.py fails if the private guard changes."""
    excl = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excl)


@custom_op("nsa::attention", mutates_args=())
def attention_op(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor,
                 v_slc: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, gates: torch.Tensor,
                 l: int, d: int, l_sel: int, n_sel: int, w: int, scale: float, backend: str,
                 tile: int | None, recompute: bool | None, allow_flash: bool,
                 flash_branches: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, HQ, dv] in q.dtype, block_idx [B, T, H, n_sel] int64), both contiguous (the fake's
    layout); no_grad: register_autograd owns the gradient, the eager op need not record a graph."""
    with torch.no_grad():
        o, block_idx = _eager(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l, d, l_sel, n_sel, w,
                              scale, backend, tile, recompute, allow_flash, flash_branches)
    return o.contiguous(), block_idx.contiguous()


@attention_op.register_fake
def _attention_fake(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l, d, l_sel, n_sel, w, scale,
                    backend, tile, recompute, allow_flash, flash_branches):
    B, T, HQ, _ = q.shape
    o = q.new_empty((B, T, HQ, v_slc.shape[3]))
    block_idx = q.new_empty((B, T, k_slc.shape[2], n_sel), dtype=torch.int64)
    return o, block_idx


@custom_op("nsa::attention_backward", mutates_args=())
def attention_backward_op(do: torch.Tensor, q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor,
                          k_slc: torch.Tensor, v_slc: torch.Tensor, k_win: torch.Tensor,
                          v_win: torch.Tensor, gates: torch.Tensor, l: int, d: int, l_sel: int,
                          n_sel: int, w: int, scale: float, backend: str, tile: int | None,
                          recompute: bool | None, allow_flash: bool,
                          flash_branches: str) -> list[torch.Tensor]:
    """Grads of (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates) for do = dL/do, by recomputing
    the eager op under autograd (module doc); an input the op does not reach (k_cmp when T < l) gets
    zeros."""
    xs = [x.detach().requires_grad_() for x in (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)]
    with _autograd_on(), torch.enable_grad():
        o, _ = _eager(*xs, l, d, l_sel, n_sel, w, scale, backend, tile, recompute, allow_flash,
                      flash_branches)
        grads = torch.autograd.grad(o, xs, do, allow_unused=True)
    return [torch.zeros_like(x, memory_format=torch.contiguous_format) if g is None else g.contiguous()
            for g, x in zip(grads, xs)]


@attention_backward_op.register_fake
def _attention_backward_fake(do, q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, *hparams):
    return [x.new_empty(x.shape) for x in (q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates)]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:len(_GRAD_INPUTS)])
    ctx.hparams = inputs[len(_GRAD_INPUTS):]


def _backward(ctx, do, _d_block_idx):
    grads = attention_backward_op(do, *ctx.saved_tensors, *ctx.hparams)
    return (*grads, *(None,) * len(ctx.hparams))


attention_op.register_autograd(_backward, setup_context=_setup_context)

_island: dict[str, object] = {}


def _eager_island():
    """nsa_attention behind torch.compiler.disable (a graph break), made once: the escape for
    arguments the op's schema cannot carry."""
    if "fn" not in _island:
        _island["fn"] = torch.compiler.disable(eager_attention)
    return _island["fn"]


def traced_attention(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, *, l, d, l_sel, n_sel, w, scale,
                     backend, tile, recompute, tuning, allow_flash, flash_branches):
    """nsa_attention while torch.compile traces: nsa::attention for the string backends (every
    library layer), after the eager op's argument checks (shapes only, so they trace). A KernelPolicy
    backend or an explicit KernelTuning has no schema type: such a call stays an eager island, which
    breaks the graph as before."""
    if not isinstance(backend, str) or tuning is not None:
        return _eager_island()(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l=l, d=d, l_sel=l_sel,
                               n_sel=n_sel, w=w, scale=scale, backend=backend, tile=tile,
                               recompute=recompute, tuning=tuning, allow_flash=allow_flash,
                               flash_branches=flash_branches)
    _check_requested(backend)
    validate_inputs(dict(q=q, k_cmp=k_cmp, v_cmp=v_cmp, k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win,
                         gates=gates), NSAParams(l, d, l_sel, n_sel, w))
    return attention_op(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, l, d, l_sel, n_sel, w,
                        safe_scale(scale, q.shape[-1]), backend, tile, recompute, allow_flash,
                        flash_branches)
