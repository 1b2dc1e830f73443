"""Where a training step goes: each kernel's time charged to the part of the model that launched it.

Categories: op (the attention kernel: nsa_attention / the dense flash call, forward and backward); the rest
of the attention layer as attn_proj (the fused q/k/v projection and o_proj), attn_cmp (NSA's block
compression of k and v), attn_gate (NSA's gate MLP) and attn_rest (RoPE, layout copies, what is left of the
layer); mlp, norms, embed_head (embedding and lm_head), optimizer, other (loss, clipping, scaler, what no
label covers). A submodule's range sits inside its layer's, and the innermost range names the category.
Forward work is labelled by record_function ranges pushed from module hooks (a recompute under gradient
checkpointing runs the hooks again, so it is charged where it belongs); backward work by the autograd node's
sequence number, which names the forward op (and so the label) that recorded it. Used by
bench/bench_profile.py split; profiling only (the hooks add host work, never syncs).
"""
from __future__ import annotations

import contextlib

import torch

CATS = ("op", "attn_proj", "attn_cmp", "attn_gate", "attn_rest", "mlp", "norms", "embed_head", "optimizer",
        "other")
PREFIX = "split:"


def label_modules(model: torch.nn.Module) -> list:
    """Forward pre/post hooks that open and close a record_function range per labelled module call."""
    from nsa.layers.attention import NSAAttention
    from nsa.layers.dense import DenseAttention
    from nsa.model.block import RMSNorm, SwiGLU
    kinds = ((NSAAttention, "attn_rest"), (DenseAttention, "attn_rest"), (SwiGLU, "mlp"), (RMSNorm, "norms"),
             (torch.nn.Embedding, "embed_head"))
    handles, head = [], getattr(model, "lm_head", None)
    parts = {}   # the attention layers' own submodules -> their category
    for mod in model.modules():
        if isinstance(mod, (NSAAttention, DenseAttention)):
            for name, cat in (("qkv_proj", "attn_proj"), ("o_proj", "attn_proj"), ("phi_k", "attn_cmp"),
                              ("phi_v", "attn_cmp"), ("gate_mlp", "attn_gate")):
                if isinstance(getattr(mod, name, None), torch.nn.Module):
                    parts[id(getattr(mod, name))] = cat
    for mod in model.modules():
        cat = parts.get(id(mod)) or next((c for k, c in kinds if isinstance(mod, k)),
                                          "embed_head" if mod is head else None)
        if cat is None:
            continue
        stack: list = []

        def pre(m, args, cat=cat, stack=stack):
            rf = torch.autograd.profiler.record_function(PREFIX + cat)
            rf.__enter__()
            stack.append(rf)

        def post(m, args, out, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return handles


@contextlib.contextmanager
def label_op():
    """The attention kernel call of either model inside a 'split:op' range."""
    import nsa.layers.attention as na
    import nsa.layers.dense as nd

    def wrap(fn):
        def inner(*a, **k):
            with torch.autograd.profiler.record_function(PREFIX + "op"):
                return fn(*a, **k)
        return inner
    saved = (na._attend, nd.dense_attention)
    na._attend, nd.dense_attention = wrap(saved[0]), wrap(saved[1])
    try:
        yield
    finally:
        na._attend, nd.dense_attention = saved


def _own_label(e) -> str | None:
    return e.name[len(PREFIX):] if e.name.startswith(PREFIX) else None


def attribute(events, cuda: bool) -> tuple[dict[str, float], float]:
    """events: torch.profiler's FunctionEvents -> (ms per category (device self time, or CPU self time),
    ms of it charged through backward autograd nodes)."""
    def label_of(e):
        while e is not None:
            if (lab := _own_label(e)) is not None:
                return lab, e
            e = e.cpu_parent
        return None, None

    # forward ops that record autograd nodes: (thread, sequence_nr) -> label
    fwd: dict[tuple[int, int], str] = {}
    for e in events:
        if getattr(e, "sequence_nr", -1) >= 0 and not e.name.startswith("autograd::"):
            lab, _ = label_of(e)
            if lab is not None:
                fwd.setdefault((e.fwd_thread if getattr(e, "fwd_thread", 0) else e.thread, e.sequence_nr), lab)
    out, via_bwd = dict.fromkeys(CATS, 0.0), 0.0
    for e in events:
        t = (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3
        if t <= 0 or (cuda and e.device_type != torch.autograd.DeviceType.CPU):
            continue
        lab, _ = label_of(e)
        if lab is None:   # backward: the nearest autograd node names its forward op
            a = e
            while a is not None and lab is None:
                if getattr(a, "sequence_nr", -1) >= 0 and a.name.startswith("autograd::engine::evaluate_function"):
                    lab = fwd.get((a.fwd_thread, a.sequence_nr))
                a = a.cpu_parent
            via_bwd += t if lab in out else 0.0
        out[lab if lab in out else "other"] += t
    return out, via_bwd


@contextlib.contextmanager
def labelled(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """Inside: the model's modules, its attention kernel and optimizer.step carry their category ranges."""
    real_step = optimizer.step

    def opt_step(*a, **k):
        with torch.autograd.profiler.record_function(PREFIX + "optimizer"):
            return real_step(*a, **k)
    optimizer.step = opt_step
    handles = label_modules(model)
    try:
        with label_op():
            yield
    finally:
        for h in handles:
            h.remove()
        optimizer.step = real_step
