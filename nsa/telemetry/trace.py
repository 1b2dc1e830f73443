"""Per-module forward/backward times and gradient norms over a few training steps (the runbooks'
NSA_TRACE_GRADS / NSA_TRACE_MODULE_BWD, config ``logging.trace_steps``).

    tr = ModuleTrace(model, optimizer, device)
    tr.begin(step); <train step>; tr.end(step, grad_norm)      # for each traced step
    json_path, csv_path = tr.write(out_dir)

Modules: every named module at most ``depth`` names deep that is not a container (TinyLM: embed,
blocks.i, blocks.i.attn_norm / attn / mlp_norm / mlp, norm, lm_head). Times are host wall clock between
hooks; on CUDA every hook synchronises the device first, so the times are the modules' own and the
traced steps are slower than the others (deliberate: only these steps). Backward time runs from the
module's backward pre-hook (gradients of its outputs ready) to its backward hook (gradients of its inputs
ready); an embedding's inputs (token ids) never need a gradient, so its backward is not timed (0 calls).
With gradient checkpointing the recompute in backward counts as a second forward call. Gradient norms are read in the optimizer's
step pre-hook: after unscaling, the DDP all-reduce and clipping (``grad_norm_update``, what the update
uses); ``grad_norm`` undoes the clipping with the step's pre-clip total norm.
"""
from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

COLUMNS = ("step", "module", "params", "fwd_ms", "fwd_calls", "bwd_ms", "bwd_calls", "grad_norm",
           "grad_norm_update")
CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def traced_modules(model: nn.Module, depth: int = 3) -> dict[str, nn.Module]:
    """{name: module} for the modules the trace times (see module doc)."""
    return {n: m for n, m in model.named_modules()
            if n and n.count(".") < depth and not isinstance(m, CONTAINERS)}


class ModuleTrace:
    """Hooks on ``model``'s modules and ``optimizer``; rows of (step, module) measurements."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 depth: int = 3) -> None:
        self.device = torch.device(device)
        self.modules = traced_modules(model, depth)
        self.params = {n: [p for p in m.parameters() if p.requires_grad] for n, m in self.modules.items()}
        self.all_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.rows: list[dict[str, Any]] = []
        self.steps: list[int] = []
        self._handles: list[Any] = []
        self._start: dict[tuple[str, str], float] = {}
        self._acc: dict[str, dict[str, float]] = {}
        self._norms: Optional[torch.Tensor] = None     # [modules + 1] squared norms at the optimizer step
        for name, mod in self.modules.items():
            self._handles += [mod.register_forward_pre_hook(self._mark(name, "fwd")),
                              mod.register_forward_hook(self._done(name, "fwd"))]
            if not isinstance(mod, nn.Embedding):   # its full backward hook would fire at its output grads
                self._handles += [mod.register_full_backward_pre_hook(self._mark(name, "bwd")),
                                  mod.register_full_backward_hook(self._done(name, "bwd"))]
        self._handles.append(optimizer.register_step_pre_hook(self._read_grads))
        self.active = False

    # ------------------------------------------------------------------ hooks
    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # sync-ok: traced steps only (the point of the trace)
        return time.perf_counter()

    def _mark(self, name: str, kind: str):
        def hook(*_: Any) -> None:
            if self.active:
                self._start[(name, kind)] = self._now()
        return hook

    def _done(self, name: str, kind: str):
        def hook(*_: Any) -> None:
            t0 = self._start.pop((name, kind), None)
            if self.active and t0 is not None:
                acc = self._acc[name]
                acc[f"{kind}_ms"] += (self._now() - t0) * 1e3
                acc[f"{kind}_calls"] += 1
        return hook

    @torch.no_grad()
    def _read_grads(self, *_: Any) -> None:
        if not self.active:
            return
        def sq(ps: list[torch.Tensor]) -> torch.Tensor:
            gs = [p.grad.detach().float().pow(2).sum() for p in ps if p.grad is not None]
            return torch.stack(gs).sum() if gs else torch.zeros((), device=self.device)
        # device ops only; read at end() with the step's other values (one transfer)
        self._norms = torch.stack([sq(self.params[n]) for n in self.modules] + [sq(self.all_params)])

    # ------------------------------------------------------------------ steps
    def begin(self, step: int) -> None:
        self._acc = {n: {"fwd_ms": 0.0, "fwd_calls": 0, "bwd_ms": 0.0, "bwd_calls": 0} for n in self.modules}
        self._start.clear()
        self._norms = None
        self.active = True

    def end(self, step: int, grad_norm: Optional[torch.Tensor] = None) -> None:
        """Close the step's measurements; ``grad_norm``: the step's pre-clip total norm (StepResult)."""
        self.active = False
        names = list(self.modules)
        norms = [math.nan] * (len(names) + 1)
        pre_total = math.nan
        if self._norms is not None:
            vals = self._norms.sqrt()
            if grad_norm is not None:
                vals = torch.cat([vals, grad_norm.detach().float().reshape(1).to(vals.device)])
            host = vals.cpu().tolist()     # sync-ok: traced steps only
            norms, pre_total = host[:len(names) + 1], (host[-1] if grad_norm is not None else math.nan)
        post_total = norms[-1]
        undo = pre_total / post_total if (post_total > 0 and math.isfinite(pre_total)) else 1.0
        for i, n in enumerate(names):
            a = self._acc[n]
            self.rows.append({"step": step, "module": n, "params": sum(p.numel() for p in self.params[n]),
                              "fwd_ms": round(a["fwd_ms"], 4), "fwd_calls": a["fwd_calls"],
                              "bwd_ms": round(a["bwd_ms"], 4), "bwd_calls": a["bwd_calls"],
                              "grad_norm": norms[i] * undo, "grad_norm_update": norms[i]})
        self.steps.append(step)

    def close(self) -> None:
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ output
    def summary(self) -> dict[str, Any]:
        return {"steps": self.steps, "device": str(self.device), "columns": list(COLUMNS),
                "note": ("host wall clock per module (CUDA: device synchronised in every hook); grad_norm "
                         "before clipping, grad_norm_update as the optimizer used it"),
                "rows": [{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                          for k, v in r.items()} for r in self.rows]}

    def write(self, out_dir: str | Path, stem: str = "trace_steps") -> tuple[Path, Path]:
        """``<out_dir>/<stem>.json`` and ``.csv`` (one row per step and module)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        jpath, cpath = out / f"{stem}.json", out / f"{stem}.csv"
        jpath.write_text(json.dumps(self.summary(), indent=2))
        with cpath.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(COLUMNS))
            w.writeheader()
            w.writerows(self.rows)
        return jpath, cpath
