"""The loop's debug steps: a module trace (``logging.trace_steps``) and a CUDA memory snapshot
(``logging.memory_snapshot_steps``) over the first steps of a launch, written to the run directory and
logged to the run's MLflow run as artifacts under ``debug/``. Both off (0) by default: then every method
is a no-op and the step is untouched.

    dbg = DebugSteps(cfg.logging, model, optimizer, device, run_dir, rank, log_artifact, start_step)
    eager = dbg.before(step)        # True: run this step eagerly (no CUDA-graph replay: hooks must fire)
    <train step>; dbg.after(step, result)
    dbg.close()                     # at the end of the run, also after a failure

The trace runs on rank 0 only (its host syncs would slow every rank alike); each rank records its own
memory snapshot (``memory/rank<r>_*``), logged to MLflow from rank 0.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

log = logging.getLogger(__name__)


class DebugSteps:
    def __init__(self, lg: Any, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device,
                 run_dir: Path, rank: int, log_artifact: Callable[[Path, Optional[str]], None],
                 start_step: int = 0) -> None:
        self.run_dir, self.rank, self.log_artifact = Path(run_dir), rank, log_artifact
        self.trace_until = start_step + lg.trace_steps if lg.trace_steps > 0 and rank == 0 else start_step
        self.mem_until = start_step + lg.memory_snapshot_steps if lg.memory_snapshot_steps > 0 else start_step
        self.trace = None
        self.snap = None
        if self.trace_until > start_step:
            from nsa.telemetry.trace import ModuleTrace
            self.trace = ModuleTrace(model, optimizer, device)
        if self.mem_until > start_step:
            from nsa.telemetry.memsnap import MemorySnapshot
            self.snap = MemorySnapshot(device)    # ValueError off CUDA (the config refuses it first)
            self.snap.start()

    def before(self, step: int) -> bool:
        """Start measuring ``step``; True when it must run eagerly."""
        if self.trace is not None and step <= self.trace_until:
            self.trace.begin(step)
            return True
        return False

    def after(self, step: int, res: Any) -> None:
        if self.trace is not None and step <= self.trace_until:
            self.trace.end(step, res.grad_norm)
            if step == self.trace_until:
                self._finish_trace()
        if self.snap is not None and step == self.mem_until:
            self._finish_snapshot()

    def _finish_trace(self) -> None:
        tr, self.trace = self.trace, None
        tr.close()
        for p in tr.write(self.run_dir / "trace"):
            self.log_artifact(p, "debug")
        print(f"module trace of steps {tr.steps}: {self.run_dir / 'trace'}", flush=True)

    def _finish_snapshot(self) -> None:
        snap, self.snap = self.snap, None
        paths = snap.dump(self.run_dir / "memory", f"rank{self.rank}_memory_snapshot")
        for p in paths:
            self.log_artifact(p, "debug")
        if self.rank == 0:
            print(f"CUDA memory snapshot through step {self.mem_until}: {paths[0]} (+ HTML views)", flush=True)

    def close(self) -> None:
        """A run that ends before the last debug step: write what was measured, stop recording."""
        try:
            if self.trace is not None and self.trace.steps:
                self._finish_trace()
            if self.snap is not None:
                self._finish_snapshot()
        except Exception as exc:  # noqa: BLE001 - debug output must never replace the run's own error
            log.warning("debug steps not written: %s", exc)
        finally:
            if self.trace is not None:
                self.trace.close()
            if self.snap is not None:
                self.snap.stop()
