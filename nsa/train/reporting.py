"""What the loop writes into the run directory: heartbeats (every rank) and, on rank 0, training.csv,
val.csv, TensorBoard events, one MLflow run, env.json, metrics.json and a loss/throughput plot.

One MLflow run per training run, across Ray restarts and resumes: rank 0 stores the run id in
``run_dir/mlflow_run.json`` and a restarted/resumed loop continues that run instead of opening a new one.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

from nsa.config import RunConfig
from nsa.telemetry import (CSVLogger, Heartbeat, MLflowLogger, MultiLogger, RollingPercentiles, build_loggers,
                           memory_mib, plot_training)

log = logging.getLogger(__name__)

MLFLOW_RUN_FILE = "mlflow_run.json"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("ray", "mlflow", "triton", "numpy", "pyarrow"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                mod = __import__(name)
            except Exception:  # optional packages: record their absence, never fail
                out[name] = "not installed"
                continue
        out[name] = str(getattr(mod, "__version__", "?"))
    import nsa
    out["nsa"] = nsa.__version__
    return out


def environment_info(device: torch.device, world_size: int, kernel_policy: str) -> dict[str, Any]:
    """env.json: versions, devices, kernel policy, threads."""
    cuda = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            cuda.append({"index": i, "name": p.name, "total_mib": p.total_memory // (1024 * 1024),
                         "capability": f"{p.major}.{p.minor}"})
    return {
        "time": time.time(), "hostname": socket.gethostname(), "platform": platform.platform(),
        "versions": _versions(), "device": str(device), "world_size": world_size, "cuda_devices": cuda,
        "cuda_version": torch.version.cuda, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "kernel_policy": kernel_policy,
        "tf32_matmul": torch.get_float32_matmul_precision(),
    }


class DeviceStepTimer:
    """Step periods as the GPU sees them, without host syncs.

    The host may run many steps ahead of a CUDA device (a replayed graph returns at once; eager launches
    queue up), so host wall time per step says little there. ``mark()`` records a CUDA event at the end
    of each step; ``drain()`` returns the periods between consecutive events that have already completed
    (``Event.query`` never blocks), i.e. the device's step-to-step time, idle gaps included. On CPU both
    are no-ops and the loop keeps host times."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.device = device
        self._pending: list[list[Any]] = []     # [step, event, gap_after]
        self._last: Optional[Any] = None
        self.latest_ms = math.nan

    def mark(self, step: int) -> None:
        if self.enabled:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self._pending.append([step, ev, False])

    def gap(self) -> None:
        """Non-training device work (eval, checkpoint, stats) follows the last mark: the next period is
        not a step time and is skipped."""
        if self._pending:
            self._pending[-1][2] = True
        else:
            self._last = None

    def drain(self) -> list[tuple[int, float]]:
        out = []
        while self._pending and self._pending[0][1].query():
            step, ev, gap_after = self._pending.pop(0)
            if self._last is not None:
                self.latest_ms = self._last.elapsed_time(ev)
                out.append((step, self.latest_ms))
            self._last = None if gap_after else ev
        return out


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def write_json(path: Path, obj: Any) -> None:
    """Replace ``path`` atomically (temp file, fsync, rename): a reader or a full disk never leaves half."""
    from nsa.fileio import atomic_write_text
    atomic_write_text(path, json.dumps(_json_safe(obj), indent=2, sort_keys=False))


class RunReporter:
    """Heartbeat + rank-0 loggers of one worker. Every method is cheap host work (no device syncs)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, rank: int, world_size: int, device: torch.device, *,
                 mlflow_uri: Optional[str], resume_step: Optional[int], window: int = 100) -> None:
        self.cfg, self.run_dir, self.rank, self.world, self.device = cfg, Path(run_dir), rank, world_size, device
        self.chief = rank == 0
        lg = cfg.logging
        self.hb = Heartbeat(self.run_dir, rank)
        self.step_ms = RollingPercentiles(window)
        self.fetch_ms = RollingPercentiles(window)
        self.train_log: MultiLogger = MultiLogger([])
        self.val_csv: Optional[CSVLogger] = None
        self.mlflow_run_id: Optional[str] = None
        if not self.chief:
            return
        self.mlflow_run_id = self._stored_mlflow_run_id() if mlflow_uri else None
        self.train_log = build_loggers(
            self.run_dir, csv_enabled=lg.csv, tensorboard=lg.tensorboard,
            mlflow_tracking_uri=mlflow_uri if lg.mlflow else None, mlflow_experiment=lg.experiment,
            run_name=self.run_dir.name, tags={"run_dir": str(self.run_dir)}, resume_step=resume_step,
            mlflow_run_id=self.mlflow_run_id)
        for sink in self.train_log.loggers:
            if isinstance(sink, MLflowLogger):
                self.mlflow_run_id = sink.run_id
                write_json(self.run_dir / MLFLOW_RUN_FILE, {"run_id": sink.run_id, "tracking_uri": mlflow_uri,
                                                             "experiment": lg.experiment})
        if resume_step is None:   # params once per MLflow run; a resumed run keeps the original ones
            self.train_log.log_params(cfg.to_dict())
        if lg.csv:
            self.val_csv = CSVLogger(self.run_dir / "val.csv", resume_step=resume_step)

    def _stored_mlflow_run_id(self) -> Optional[str]:
        f = self.run_dir / MLFLOW_RUN_FILE
        if not f.is_file():
            return None
        try:
            return json.loads(f.read_text()).get("run_id")
        except (OSError, json.JSONDecodeError):
            return None

    # ------------------------------------------------------------------ per step
    def heartbeat(self, kind: str, step: int, **fields: Any) -> None:
        self.hb.write(kind, step, **fields)

    def timing_fields(self) -> dict[str, float]:
        return {"step_ms_p50": self.step_ms.p50, "step_ms_p95": self.step_ms.p95,
                "fetch_ms_p50": self.fetch_ms.p50, "fetch_ms_p95": self.fetch_ms.p95}

    def memory(self) -> dict[str, float]:
        return memory_mib(self.device)

    def log_train(self, metrics: dict[str, float], step: int) -> None:
        if self.chief:
            self.train_log.log(metrics, step)

    def log_val(self, metrics: dict[str, float], step: int) -> None:
        if self.chief and self.val_csv is not None:
            self.val_csv.log(metrics, step)

    # ------------------------------------------------------------------ start / end
    def write_env(self, kernel_policy: str) -> None:
        if self.chief:
            write_json(self.run_dir / "env.json", environment_info(self.device, self.world, kernel_policy))

    def finish(self, summary: dict[str, Any], status: str) -> None:
        """metrics.json, plot, MLflow artifacts + final status; heartbeat closed on every rank."""
        try:
            if self.chief:
                write_json(self.run_dir / "metrics.json", summary)
                self._artifacts()
                if self.val_csv is not None:
                    self.val_csv.close()
                self.train_log.close(status)
        finally:
            self.hb.close()

    def _artifacts(self) -> None:
        csv_path = self.run_dir / "training.csv"
        png = self.run_dir / "training.png"
        if csv_path.is_file():
            try:
                plot_training(csv_path, png, title=self.run_dir.name)
            except Exception as exc:  # a plot must never fail a finished run
                log.warning("training plot not written: %s", exc)
        for name in ("config.yaml", "metrics.json", "env.json", "training.png", "training.csv", "val.csv"):
            if (self.run_dir / name).is_file():
                self.train_log.log_artifact(self.run_dir / name)
