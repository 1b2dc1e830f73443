"""Eager NSA op calls replayed from per-signature CUDA graphs (issue 45 item 3: an eager call is bound by its host
work, Triton launches, FA4 entries and autograd; a replay launches every kernel at once).

With NSA_EAGER_GRAPHS=auto (nsa/config/env.py; the default, off turns it off) an eager nsa_attention call on CUDA
on the Triton route, outside any capture, whose call signature (eager.py's key, plus the autocast and
inference-mode state) was seen before (under saved-tensor hooks, e.g. checkpointing: from its first call; see
graphed_call) is served by graphs captured for that signature: the op's forward and, where a gradient is wanted,
its backward, both in one private memory pool. A call

- copies its eight inputs into the graphs' static inputs (same shapes, strides and 16-byte alignment), replays the
  forward and returns copies of the outputs (the next layer's call replays the same graph);
- copies what the backward reads into one buffer of its own: every storage the forward made that is still alive
  after it (the tensors autograd saved, a Function's ctx attributes, the outputs), found while capturing;
- in backward puts its inputs and that buffer back, copies dO in, replays the backward and returns copies of the
  gradients.

The same kernels run on the same values, so results are bitwise the eager path's (where eager repeats itself: FA4's
and cuDNN's backwards need not). Switches outside the key that eager kernels read per call (TF32, SDPA backend
toggles) are the capture's. A signature's capture costs a warm-up call and one device sync (torch.cuda.graph's).
A capture that fails serves the signature eagerly from then on, each call counted as FALLBACK. Graphs are kept for
MAX_GRAPHS signatures (least recently used dropped; one still awaiting a backward lives until then; one whose
checkpointed forward still awaits its recomputation is not dropped, and a new signature runs eagerly while every
kept one is so held). Capture and replay sit behind a backend object (CudaGraphs; tests/test_eager_graph.py fakes
it on CPU). Kept constants a graph reads (per-shape maps in lru caches) are held while it lives when a torch op or
a Triton launch read them during the capture, or the captured autograd graph holds them.
"""
from __future__ import annotations

import collections
import contextlib
import logging
from typing import Callable

import torch
from torch.autograd.function import once_differentiable
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from nsa.config.env import eager_graphs

from .fallbacks import count_fallback

ON = eager_graphs() == "auto"   # read once; tests set it
MAX_GRAPHS = 8                  # signatures with graphs (each holds a pool of its fwd + bwd peak memory)
FALLBACK = "eager_graph->eager"
UNSUPPORTED = "triton_unsupported->torch"   # eager._triton_run's: such a call runs the torch backend
log = logging.getLogger(__name__)
_PAUSED = [0]                   # paused() depth; process-wide: a checkpointed forward's recomputation runs on the
                                # autograd engine's thread and must decide as its forward did


@contextlib.contextmanager
def paused():
    """Calls inside run as is, captured or replayed never: for eager steps of a whole-step graph (its warm-up), whose
    own capture makes per-call graphs a cost in memory with nothing to win."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


def _sid(t: torch.Tensor) -> int | None:
    """The identity of t's storage (its StorageImpl), None for a tensor without one."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _flat(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage, with a version counter of its own."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class Made(TorchDispatchMode):
    """While active: the storages torch ops create, in creation order and held weakly (a temporary still dies), and
    the tensors they read that were made before (held strongly: a kept constant stays allocated). own: tensors that
    are neither (the static inputs)."""

    def __init__(self, own=()):
        super().__init__()
        self.order: dict[int, StorageWeakRef] = {}
        self.reads: dict[int, torch.Tensor] = {}
        self.own = {_sid(t) for t in own}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {s: t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and (s := _sid(t)) is not None}
        self.read(ins)
        for t in tree_leaves(out):   # in-place ops and views return an input's storage: not made here
            s = _sid(t) if isinstance(t, torch.Tensor) else None
            if s is not None and s not in ins and s not in self.order and t.untyped_storage().nbytes():
                self.order[s] = StorageWeakRef(t.untyped_storage())
        return out

    def read(self, ins: dict) -> None:
        for s, t in ins.items():
            if s not in self.order and s not in self.own and s not in self.reads:
                self.reads[s] = t

    def alive(self) -> list[torch.Tensor]:
        """uint8 views of the made storages still alive, in creation order."""
        out = []
        for ref in self.order.values():
            st = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if st is not None:
                out.append(_flat(st))
        return out


@contextlib.contextmanager
def _triton_reads(made: Made):
    """Tensors passed to Triton launches count as reads too (a kernel may take a kept map no torch op touches)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    orig = JITFunction.run

    def run(self, *args, **kwargs):
        made.read({s: t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and (s := _sid(t))})
        return orig(self, *args, **kwargs)
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = orig


class CudaGraphs:
    """The capture backend: torch.cuda graphs in one private pool per signature."""

    device_type = "cuda"

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def warm(self, fn: Callable) -> None:
        """Run fn once on a side stream (what torch asks before a capture)."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)

    def capture(self, fn: Callable, pool) -> tuple[Callable, object]:
        """(replay, what fn returned while captured). thread_local: another thread's CUDA calls (a loader pinning
        memory) do not break the capture; the autograd engine's own thread captures the backward's kernels."""
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
            out = fn()
        return g.replay, out


BACKEND = CudaGraphs()


def _twin(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of x's shape, strides, dtype and data_ptr() % 16 (the signature's alignment)."""
    es = x.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if n > 0)
    base = torch.empty(extent + max(1, 16 // es), dtype=x.dtype, device=x.device)
    return base.as_strided(x.shape, x.stride(), (x.data_ptr() - base.data_ptr()) % 16 // es)


def _leaf(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor on x's memory with a version counter of its own (copies into x do not bump it), requiring grad as
    `like` does: what the captured op is called on."""
    t = torch.empty(0, dtype=x.dtype, device=x.device).set_(x.untyped_storage(), x.storage_offset(), x.shape,
                                                             x.stride())
    return t.requires_grad_(like.requires_grad)


def _autocast_no_cache(dev: str):
    """The caller's autocast, without its cast cache (cached casts made in a capture would outlive it)."""
    if not torch.is_autocast_enabled(dev):
        return contextlib.nullcontext()
    return torch.autocast(dev, dtype=torch.get_autocast_dtype(dev), cache_enabled=False)


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()   # a saved output holds no grad_fn: no reference cycle keeps a dropped graph's pool


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _copy(dst: list, src) -> None:
    """dst[i] <- src[i], one foreach launch; never recorded by autograd (a static buffer must not join the
    caller's graph)."""
    if dst:
        with torch.no_grad():
            torch._foreach_copy_(dst, list(src))


class Graphed:
    """One signature's captured forward (and backward), their static buffers and what a call keeps for backward."""

    def __init__(self, call, tensors: tuple, backend):
        self.call = call   # the eager decisions it was captured from (served only to calls of the same)
        self.pending = 0   # checkpointed forwards replayed whose recomputation has not replayed yet
        self.static = [_twin(x) for x in tensors]
        _copy(self.static, tensors)
        leaves = [_leaf(s, x) for s, x in zip(self.static, tensors)]
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
        self.need = tuple(i for i, x in enumerate(tensors) if x.requires_grad) if grad else ()
        wrt = [leaves[i] for i in self.need]

        def fwd():
            return call.run(*leaves)

        def warm():
            o = fwd()[0]
            if wrt:
                torch.autograd.grad(o, wrt, torch.zeros_like(o), allow_unused=True)

        # own saved-tensor hooks: a caller's (checkpointing's, which drop what autograd saves) stay out of the graphs
        with _autocast_no_cache(tensors[0].device.type), torch.autograd.graph.saved_tensors_hooks(_detached, _same):
            backend.warm(warm)
            pool = backend.pool()
            made = Made(own=self.static)
            with made, _triton_reads(made):
                self.fwd, self.out = backend.capture(fwd, pool)
            self.keep = made.reads   # constants read, held while the graph lives
            self.state = made.alive()
            self.sizes = [t.numel() for t in self.state]
            if wrt:   # retain_graph: the captured autograd graph (its ctx objects, kept maps) lives on with it
                self.dout = torch.zeros_like(self.out[0])
                self.bwd, self.grads = backend.capture(
                    lambda: torch.autograd.grad(self.out[0], wrt, self.dout, retain_graph=True, allow_unused=True),
                    pool)

    def __call__(self, tensors: tuple):
        if self.need:
            return _Replay.apply(self, *tensors)
        return self.forward(None, tensors)

    def forward(self, ctx, xs: tuple):
        _copy(self.static, xs)
        self.fwd()
        o, block_idx = (t.clone() for t in self.out)
        if ctx is not None:   # saved as the eager op's tensors are: freed after a backward without retain_graph
            ctx.g = self
            state = torch.empty(sum(self.sizes), dtype=torch.uint8, device=o.device)
            _copy(state.split(self.sizes), self.state)
            ctx.save_for_backward(*xs, state)   # xs: the caller's own tensors (version-checked as the eager op's)
            ctx.mark_non_differentiable(block_idx)
        return o, block_idx

    def backward(self, ctx, do: torch.Tensor) -> list:
        *xs, state = ctx.saved_tensors
        _copy(self.static, xs)
        _copy(self.state, state.split(self.sizes))
        self.dout.copy_(do)
        self.bwd()
        grads = [None] * len(self.static)
        for i, g in zip(self.need, self.grads):
            grads[i] = None if g is None else g.clone()
        return grads


class _Replay(torch.autograd.Function):
    """A graphed call under autograd: Graphed.forward / backward."""

    @staticmethod
    def forward(ctx, g: Graphed, *xs):
        return g.forward(ctx, xs)

    @staticmethod
    @once_differentiable
    def backward(ctx, do, _d_block_idx):
        return (None, *ctx.g.backward(ctx, do))


_GRAPHS: collections.OrderedDict = collections.OrderedDict()   # signature -> Graphed, or None: capture failed


def _hooked() -> bool:
    """Saved-tensor hooks are on (activation checkpointing: it counts what a forward and its recomputation save)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(True) is not None


def graphed_call(call, key: tuple, tensors: tuple, seen: bool):
    """eager.py's call `call` (kept under `key`; seen: not its signature's first) on its graphs where it qualifies,
    else run as is. Captured at a signature's second call; under saved-tensor hooks at its first, so that a
    checkpointed forward and its recomputation in backward both replay (the same tensors saved), and never inside a
    backward (a recomputation whose forward ran eagerly runs eagerly too)."""
    dev = tensors[0].device.type
    if (call.policy.backend != "triton" or UNSUPPORTED in call.counts or dev != BACKEND.device_type
            or _PAUSED[0]):
        return call.run(*tensors)
    gkey = (key, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), torch.is_inference_mode_enabled())
    g = _GRAPHS.get(gkey, False)
    hooked, in_backward = _hooked(), torch._C._current_graph_task_id() != -1
    if g is False or g is not None and g.call is not call:
        if not (seen or hooked) or in_backward or not _room():
            return call.run(*tensors)
        g = _capture(call, gkey, tensors)
    else:
        _GRAPHS.move_to_end(gkey)
    if g is None:
        count_fallback(FALLBACK)
        return call.run(*tensors)
    if hooked:   # a checkpointed forward (+1) or its recomputation (-1): kept until they pair up
        g.pending = max(0, g.pending + (-1 if in_backward else 1))
    return g(tensors)


def _room() -> bool:
    """Whether a new signature may be captured: MAX_GRAPHS not reached, or an entry to drop that no checkpointed
    forward still waits on (its recomputation must replay what the forward replayed: the same tensors saved)."""
    return len(_GRAPHS) < MAX_GRAPHS or any(g is None or g.pending == 0 for g in _GRAPHS.values())


def _capture(call, gkey: tuple, tensors: tuple) -> Graphed | None:
    try:
        g = Graphed(call, tensors, BACKEND)
    except Exception as exc:  # noqa: BLE001 - whatever a capture refuses (a host sync, an op graphs lack): eager
        log.warning("eager graphs: capture failed (%s: %s); this call signature runs eagerly", type(exc).__name__,
                    str(exc)[:200])
        g = None
    _GRAPHS[gkey] = g
    while len(_GRAPHS) > MAX_GRAPHS:   # the least recently used no checkpointed forward waits on (_room)
        old = next(k for k, v in _GRAPHS.items() if k != gkey and (v is None or v.pending == 0))
        del _GRAPHS[old]
    return g


def clear() -> None:
    """Forget every kept graph (tests; their pools are freed once no pending backward holds them)."""
    _GRAPHS.clear()
