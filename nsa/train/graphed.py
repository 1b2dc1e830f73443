"""The whole optimizer step (forward, backward, clip, AdamW, non-finite skip) as one replayed CUDA graph.

Why: at the production size (125M, batch 1 x 2048) one eager step issues ~3-5k kernel launches and the
host needs longer to issue them than the GPU needs to run them. Then every bit of extra host work (a Ray
worker's threads, the GIL) shows up in the step time. Replaying a captured graph costs the host ~0.1 ms,
so the GPU paces the step and host-side extras run in its shadow.

How (``GraphedStep``):
- calls 1..``warmup`` run the eager ``train_step`` on a side stream (real steps on real batches: they
  also allocate AdamW's state and compile every Triton kernel / torch.compile graph);
- the next call captures ``train_step`` on static input buffers and then replays it once (capture only
  records), so that call is a real step too; later calls copy the batch into the static buffers and replay.
- The learning rate lives in one CUDA tensor per param group (fused AdamW reads it on device), refreshed by
  the scheduler with ``fill_`` (torch >= 2.5) or by us from the host value the schedule computed.
- Data parallel: DDP's reducer hooks cannot be captured, so with world_size > 1 the model stays bare,
  rank 0's parameters are broadcast once, and ``allreduce_mean_grads`` (one NCCL all-reduce of the flat
  gradients, captured in the graph) replaces DDP.
- Steps the graph cannot express run eagerly on the same parameters and optimizer state: fault injection
  (``poison``), and steps that record gate/selection stats. The graph's gradients live in its private
  pool; an eager step allocates its own and frees them, so both kinds interleave safely.
Autocast's weight-cast cache is disabled for every step taken through this class (a cache filled
during capture would pin tensors of the capture).

``graph_unsupported`` says why a configuration cannot be captured (the loop then stays eager and logs why).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from nsa.ops import eager_graph
from nsa.train.precision import Precision
from nsa.train.step import StepResult, train_step


def allreduce_mean_grads(params: list[torch.Tensor]) -> None:
    """Average ``.grad`` over the default process group with ONE all-reduce of a flat fp32 buffer, in a
    fixed parameter order (the same on every rank). Capturable: NCCL collectives record into CUDA graphs."""
    import torch.distributed as dist
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(f)


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters and buffers equal to rank ``src``'s (what DDP does at construction)."""
    import torch.distributed as dist
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src)


def graph_unsupported(model: nn.Module, optimizer: torch.optim.Optimizer, prec: Precision,
                      device: torch.device, sharding: str = "ddp") -> Optional[str]:
    """None if the step can be captured, else the reason (one line)."""
    if device.type != "cuda":
        return f"device is {device.type}: CUDA graphs need a CUDA device"
    if sharding == "fsdp":
        return ("runtime.sharding=fsdp: FSDP's per-block all-gathers and reduce-scatters run from hooks that "
                "are not captured")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return ("model is wrapped in DDP: its reducer hooks are not captured; pass the bare model and "
                "grad_sync=allreduce_mean_grads (the loop does this)")
    if prec.uses_scaler:
        return "fp16 with GradScaler: the dynamic loss scale is not captured; use bf16"
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return "optimizer is not fused AdamW: the non-finite skip would need a host sync"
    return None


class GraphedStep:
    """Drop-in for ``train_step(model, micro, optimizer, scheduler, prec, grad_clip=...)``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, prec: Precision, *, grad_clip: float,
                 device: torch.device, warmup: int = 3,
                 grad_sync: Optional[Callable[[list[torch.Tensor]], None]] = None) -> None:
        why = graph_unsupported(model, optimizer, prec, device)
        if why is not None:
            raise ValueError(f"runtime.cuda_graph=true cannot be used here: {why}")
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one eager step must run before capture")
        self.model, self.opt, self.sched = model, optimizer, scheduler
        self.prec = dataclasses.replace(prec, autocast_cache=False)
        self.grad_clip, self.device, self.warmup = grad_clip, device, warmup
        self.grad_sync = grad_sync
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_in: list[torch.Tensor] = []
        self.static_out: Optional[StepResult] = None
        self.eager_steps = 0
        self.replays = 0
        self._stream = torch.cuda.Stream(device)
        self._lr = self._lr_tensors()

    # ------------------------------------------------------------------ learning rate on device
    def _lr_tensors(self) -> list[torch.Tensor]:
        out = []
        for g in self.opt.param_groups:
            v = g["lr"]
            host = float(v.item() if isinstance(v, torch.Tensor) else v)  # sync-ok: once, at construction
            t = torch.tensor(host, dtype=torch.float32, device=self.device)
            g["lr"] = t
            g["capturable"] = True      # AdamW's capture health check; the fused kernel is capturable
            out.append(t)
        return out

    def _sync_lr(self) -> None:
        """The scheduler may have replaced a tensor lr by a float (torch < 2.5): copy it back in."""
        for g, t in zip(self.opt.param_groups, self._lr):
            if g["lr"] is not t:
                v = g["lr"]
                t.fill_(v if not isinstance(v, torch.Tensor) else v.to(t.device))
                g["lr"] = t

    # ------------------------------------------------------------------ steps
    def _run_eager(self, micro: Sequence[torch.Tensor], poison: bool) -> StepResult:
        cur = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(cur)
        self.eager_steps += 1
        # warm-up off the default stream (capture rule); the op's per-call graphs would only hold memory here
        with torch.cuda.stream(self._stream), eager_graph.paused():
            res = train_step(self.model, micro, self.opt, self.sched, self.prec, grad_clip=self.grad_clip,
                             poison=poison, grad_sync=self.grad_sync)
        cur.wait_stream(self._stream)
        return res

    def _capture(self, micro: Sequence[torch.Tensor]) -> None:
        self.static_in = [m.clone() for m in micro]
        self.opt.zero_grad(set_to_none=True)
        g = torch.cuda.CUDAGraph()
        # the scheduler must not advance during capture; it is stepped after each replay instead
        had = "step" in vars(self.sched)
        saved = vars(self.sched).get("step")
        self.sched.step = lambda *a, **k: None   # type: ignore[method-assign]
        try:
            # thread_local: other threads of the process (Ray Data's prefetch, pin_memory) keep using CUDA
            with torch.cuda.graph(g, stream=self._stream, capture_error_mode="thread_local"):
                self.static_out = train_step(self.model, self.static_in, self.opt, self.sched, self.prec,
                                             grad_clip=self.grad_clip, grad_sync=self.grad_sync)
        finally:
            if had:
                self.sched.step = saved
            else:
                del self.sched.step
        self.graph = g

    def __call__(self, micro: Sequence[torch.Tensor], *, poison: bool = False,
                 eager: bool = False) -> StepResult:
        """One optimizer step. ``eager`` forces an eager step (e.g. to record stats)."""
        self.calls += 1
        self._sync_lr()
        if poison or eager or (self.graph is None and self.calls <= self.warmup):
            return self._run_eager(micro, poison)
        if self.graph is None:
            cur = torch.cuda.current_stream(self.device)
            self._stream.wait_stream(cur)
            self._capture(micro)
            cur.wait_stream(self._stream)
        elif [tuple(m.shape) for m in micro] != [tuple(s.shape) for s in self.static_in]:
            return self._run_eager(micro, poison)   # e.g. a short last batch: correct, just not replayed
        else:
            for s, m in zip(self.static_in, micro):
                s.copy_(m, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        self.sched.step()
        out = self.static_out
        # the outputs are overwritten by the next replay: hand out copies (device ops, no sync)
        return StepResult(loss=out.loss.clone(), grad_norm=out.grad_norm.clone(), finite=out.finite.clone(),
                          tokens=out.tokens)


def single_device_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                       scheduler: torch.optim.lr_scheduler.LRScheduler, prec: Precision, runtime_cfg: object, *,
                       grad_clip: float, device: torch.device) -> tuple[Callable[..., StepResult], str]:
    """(step(micro_batches) -> StepResult, mode text) for a one-device loop (benchmarks, profiler): the
    graphed step where ``runtime_cfg.cuda_graph`` is on and applies, else ``train_step``."""
    why = graph_unsupported(model, optimizer, prec, device) if getattr(runtime_cfg, "cuda_graph", False) else None
    if getattr(runtime_cfg, "cuda_graph", False) and why is None:
        return (GraphedStep(model, optimizer, scheduler, prec, grad_clip=grad_clip, device=device,
                            warmup=runtime_cfg.cuda_graph_warmup), "cuda_graph")

    def step(micro: Sequence[torch.Tensor]) -> StepResult:
        return train_step(model, micro, optimizer, scheduler, prec, grad_clip=grad_clip)
    return step, "eager" if why is None else f"eager ({why})"


def close_step(step: object) -> None:
    """Release a GraphedStep's graph (and with it any captured NCCL work) before the process group goes."""
    if isinstance(step, GraphedStep) and step.graph is not None:
        torch.cuda.synchronize(step.device)  # sync-ok: end of training
        step.graph.reset()
        step.graph = None


def host_lr(scheduler: torch.optim.lr_scheduler.LRScheduler) -> float:
    """The first group's current lr as a host float without reading a device tensor (no sync)."""
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas:
        return float(scheduler.base_lrs[0] * lambdas[0](scheduler.last_epoch))
    v = scheduler.get_last_lr()[0]
    return float(v) if not isinstance(v, torch.Tensor) else float(v.item())  # sync-ok: non-Lambda schedules only
