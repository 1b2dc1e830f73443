"""Metric sinks behind one interface: CSV, TensorBoard, MLflow, and a fan-out that isolates failures.

The loop only calls ``logger.log(metrics, step)`` with host floats (see ``stats.to_host``); it never
imports mlflow or tensorboard (docs/design.md, principle 5). Heavy libraries are imported lazily, when a sink
is constructed.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import numbers
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class MetricLogger:
    """Base sink. ``log`` is required; params/artifacts are optional (no-ops here).

    As a context manager it closes with status FAILED when the block raises.
    """

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Run parameters (e.g. the resolved config). Default: ignored."""

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """A file or directory to keep with the run. Default: ignored."""

    def close(self, status: str = "FINISHED") -> None:
        """Flush and release; ``status`` is FINISHED, FAILED or KILLED."""

    def __enter__(self) -> "MetricLogger":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")


def _check_status(status: str) -> str:
    if status not in RUN_STATUSES:
        raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
    return status


def flatten_params(params: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts/dataclasses -> ``{"model.dim": "512", ...}`` with string values."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    if not isinstance(params, Mapping):
        return {prefix or "value": str(params)}
    out: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) or (dataclasses.is_dataclass(value) and not isinstance(value, type)):
            out.update(flatten_params(value, name))
        elif isinstance(value, (list, tuple)):
            out[name] = json.dumps(value, default=str)
        else:
            out[name] = str(value)
    return out


def _csv_cell(value: Any) -> Any:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if _is_number(value):
        return repr(float(value))  # full precision; nan/inf as 'nan'/'inf' (float() reads them back)
    return "" if value is None else str(value)


class CSVLogger(MetricLogger):
    """``training.csv``: one row per ``log`` call, ``step`` first.

    Columns: ``step``, then ``fields`` (if given), then every new key in order of first appearance.
    When a key appears that the header lacks (gate stats every N steps, eval loss later), the file is
    rewritten once with the wider header (to a temp file, then an atomic rename): every row keeps
    every column, so any CSV reader works, and nothing is dropped. Missing values are empty cells.
    Rewrites happen only when the column set grows, which is rare. An existing file is appended to;
    with ``resume_step`` its rows after that step (logged before a crash, about to be redone) are
    dropped first.
    """

    def __init__(self, path: str | os.PathLike, fields: Sequence[str] | None = None, *,
                 resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._columns: list[str] = ["step"]
        for name in fields or ():
            if name not in self._columns:
                self._columns.append(name)
        self._fh = None
        rows, header = self._read_existing()
        if header is not None:
            kept = rows if resume_step is None else [r for r in rows if _row_step(r) is not None
                                                     and _row_step(r) <= resume_step]
            merged = header + [c for c in self._columns if c not in header]
            if merged != header or len(kept) != len(rows):
                self._columns = merged
                self._write_all(kept)
            else:
                self._columns = header
        else:
            self._write_all([])
        self._fh = open(self.path, "a", newline="", encoding="utf-8")

    @property
    def columns(self) -> list[str]:
        return list(self._columns)

    def _read_existing(self) -> tuple[list[dict[str, str]], list[str] | None]:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return [], None
        with open(self.path, newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            return rows, list(reader.fieldnames or ["step"])

    def _write_all(self, rows: Iterable[Mapping[str, Any]]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:   # temp file, fsync, rename: a failed rewrite (full disk) leaves the old file whole
            with open(tmp, "w", newline="", encoding="utf-8") as fh:
                writer = csv.DictWriter(fh, fieldnames=self._columns, restval="", extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        row = {"step": int(step)}
        row.update({str(k): v for k, v in metrics.items() if k != "step"})
        with self._lock:
            if self._fh is None:
                raise ValueError(f"CSVLogger({self.path}) is closed")
            new = [k for k in row if k not in self._columns]
            if new:
                self._fh.close()
                rows, _ = self._read_existing()
                self._columns.extend(new)
                self._write_all(rows)
                self._fh = open(self.path, "a", newline="", encoding="utf-8")
            writer = csv.DictWriter(self._fh, fieldnames=self._columns, restval="")
            writer.writerow({k: _csv_cell(v) for k, v in row.items()})
            self._fh.flush()

    def close(self, status: str = "FINISHED") -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def _row_step(row: Mapping[str, str]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


class TensorBoardLogger(MetricLogger):
    """Scalars to ``log_dir`` via ``torch.utils.tensorboard``; a no-op (one warning) without it."""

    def __init__(self, log_dir: str | os.PathLike, *, flush_secs: int = 30) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            log.warning("TensorBoard logging disabled: %s (pip install tensorboard)", exc)
            return
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            if _is_number(value):
                self._writer.add_scalar(str(key), float(value), int(step))

    def log_params(self, params: Mapping[str, Any]) -> None:
        if self._writer is None:
            return
        flat = flatten_params(params)
        table = "| param | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in flat.items())
        self._writer.add_text("params", table)

    def close(self, status: str = "FINISHED") -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _mlflow_key(key: str, limit: int) -> str:
    """MLflow accepts ``[/\\w.\\- ]`` and normalised relative paths; replace anything else."""
    cleaned = "".join(c if (c.isalnum() or c in "/_.- ") else "_" for c in str(key))
    parts = [p for p in cleaned.split("/") if p not in ("", ".", "..")]
    return ("/".join(parts) or "_")[:limit]


def _truncate(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    marker = "...[truncated]"
    return value[: max(0, limit - len(marker))] + marker


def _default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Artifacts beside a SQLite store (MLflow's default is ./mlruns of whatever the cwd is)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    db_path = Path(tracking_uri[len(prefix):])
    if not db_path.is_absolute():
        log.warning("MLflow tracking URI %r is relative: Ray workers run in other directories; "
                    "use sqlite:////abs/path/mlflow.db", tracking_uri)
    safe = "".join(c if (c.isalnum() or c in "_.-") else "_" for c in experiment)
    return (db_path.resolve().parent / "mlartifacts" / safe).as_uri()


def ensure_local_store(tracking_uri: str) -> None:
    """Create a new SQLite store with its artifact root beside the database (``<db dir>/mlartifacts``).

    MLflow creates the ``Default`` experiment (id 0) when it first creates the tables, with the artifact
    root of the client that does it: ``./mlruns`` of the current directory, which for a Ray worker is a
    folder in Ray's temp dir that goes away with the cluster. Creating the store here first gives Default
    the same home as every other experiment. A store that exists already is left as it is."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return
    db_path = Path(tracking_uri[len(prefix):]).resolve()
    if db_path.is_file() and db_path.stat().st_size > 0:
        return
    db_path.parent.mkdir(parents=True, exist_ok=True)
    root = (db_path.parent / "mlartifacts").as_uri()
    try:
        from mlflow.tracking._tracking_service.utils import _get_sqlalchemy_store as make_store
    except ImportError:   # the store class itself, where that helper moved
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as make_store
    try:
        store = make_store(tracking_uri, root)
    except Exception:     # another process created the tables first: fine if the store now opens
        store = make_store(tracking_uri, root)
    getattr(store, "_dispose_engine", lambda: None)()


class MLflowLogger(MetricLogger):
    """One MLflow run through ``MlflowClient`` (no fluent global state, no ``set_experiment``).

    ``tracking_uri``: e.g. ``sqlite:////abs/path/mlflow.db``. The experiment is created with
    ``MlflowClient.create_experiment`` if missing (see docs/ray.md: ``mlflow.set_experiment`` leaks
    ``MLFLOW_EXPERIMENT_ID`` into Ray). ``run_id`` continues an existing run (a resumed job: keep
    ``logger.run_id`` in the checkpoint). Params are flattened with dotted keys and truncated to
    MLflow's limits; metrics are batch-logged. Each synchronous ``log`` is a SQLite transaction
    (tens of ms on a busy 2-core box): log every N steps, or pass ``synchronous=False`` to queue
    metric batches on MLflow's background thread (``close`` waits for them).
    """

    def __init__(self, tracking_uri: str, experiment: str, run_name: str | None = None,
                 params: Mapping[str, Any] | None = None, *, tags: Mapping[str, str] | None = None,
                 artifact_location: str | None = None, run_id: str | None = None,
                 synchronous: bool = True, system_metrics: bool = False,
                 system_metrics_interval: float = 10.0) -> None:
        if not tracking_uri or not isinstance(tracking_uri, str):
            raise ValueError("tracking_uri must be a non-empty URI such as sqlite:////abs/path/mlflow.db")
        if not experiment:
            raise ValueError("experiment must be a non-empty experiment name")
        try:
            from mlflow import MlflowClient
            from mlflow.utils import validation as _v
        except ImportError as exc:
            raise ImportError(f"MLflowLogger needs mlflow ({exc}); pip install mlflow==3.17.2 "
                              "or turn MLflow logging off in the config") from exc
        self.tracking_uri = tracking_uri
        self.synchronous = bool(synchronous)
        self._pending: list[Any] = []  # RunOperations of asynchronous batches
        ensure_local_store(tracking_uri)          # Default's artifacts beside the store, not in Ray's temp dir
        self.client = MlflowClient(tracking_uri)
        self._max_param = int(getattr(_v, "MAX_PARAM_VAL_LENGTH", 6000))
        self._max_key = int(getattr(_v, "MAX_ENTITY_KEY_LENGTH", 250))
        self._max_params_batch = int(getattr(_v, "MAX_PARAMS_TAGS_PER_BATCH", 100))
        self._max_metrics_batch = int(getattr(_v, "MAX_METRICS_PER_BATCH", 1000))
        self.experiment_id = self._get_or_create_experiment(
            experiment, artifact_location or _default_artifact_location(tracking_uri, experiment))
        if run_id:
            self.client.get_run(run_id)  # raises if it does not exist
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name,
                                         tags={str(k): str(v) for k, v in (tags or {}).items()})
            self.run_id = run.info.run_id
        self._closed = False
        self._monitor = start_system_metrics(self.run_id, tracking_uri, resume=bool(run_id),
                                             interval=system_metrics_interval) if system_metrics else None
        if params:
            self.log_params(params)

    def _get_or_create_experiment(self, name: str, artifact_location: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, artifact_location=artifact_location)
            except Exception:  # another worker created it first
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            self.client.restore_experiment(exp.experiment_id)
        return exp.experiment_id

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric
        ts = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k, self._max_key), float(v), ts, int(step))
                 for k, v in metrics.items() if _is_number(v)]
        for i in range(0, len(batch), self._max_metrics_batch):
            op = self.client.log_batch(self.run_id, metrics=batch[i:i + self._max_metrics_batch],
                                       synchronous=self.synchronous)
            if not self.synchronous and op is not None:
                self._pending.append(op)
        if len(self._pending) > 256:
            self._pending = [op for op in self._pending if not _op_done(op)]

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        flat = flatten_params(params)
        batch = [Param(_mlflow_key(k, self._max_key), _truncate(v, self._max_param)) for k, v in flat.items()]
        for i in range(0, len(batch), self._max_params_batch):
            chunk = batch[i:i + self._max_params_batch]
            try:
                self.client.log_batch(self.run_id, params=chunk)
            except Exception:  # e.g. a resumed run re-logging a changed value: keep the others
                for param in chunk:
                    try:
                        self.client.log_batch(self.run_id, params=[param])
                    except Exception as exc:
                        log.warning("MLflow param %r not logged: %s", param.key, str(exc).splitlines()[0])

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def close(self, status: str = "FINISHED") -> None:
        _check_status(status)
        if not self._closed:
            self._closed = True
            pending, self._pending = self._pending, []
            monitor, self._monitor = self._monitor, None
            try:
                if monitor is not None:   # its last sample lands before the run is marked terminated
                    monitor.finish()
                for op in pending:
                    op.wait()
            finally:
                self.client.set_terminated(self.run_id, status=status)


def start_system_metrics(run_id: str, tracking_uri: str, *, resume: bool = False,
                         interval: float = 10.0) -> Any:
    """MLflow's system-metrics thread (``system/cpu_utilization_percentage``, memory, disk, network and,
    with nvidia-ml-py, ``system/gpu_*``) for a run made with ``MlflowClient.create_run``: the fluent
    ``start_run(log_system_metrics=True)`` only covers runs it starts itself. None when disabled by
    ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false`` or unavailable (psutil missing): never fatal."""
    from nsa.config import mlflow_system_metrics_on
    if not mlflow_system_metrics_on():
        return None
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, resume_logging=resume,
                                       tracking_uri=tracking_uri)
    except Exception as exc:   # psutil missing, an MLflow without the module: metrics off, training on
        log.warning("MLflow system metrics off: %s", str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    if not any(type(m).__name__ in ("GPUMonitor", "ROCMMonitor") for m in monitor.monitors):
        try:
            import torch
            if torch.cuda.is_available():
                log.warning("MLflow system metrics without GPU utilisation/memory: "
                            "pip install nvidia-ml-py for system/gpu_* metrics")
        except ImportError:
            pass
    monitor.start()
    return monitor


def _op_done(op: Any) -> bool:
    """Whether an MLflow RunOperations has finished (private attribute; False if unknown)."""
    futures = getattr(op, "_operation_futures", None)
    return futures is not None and all(f.done() for f in futures)


class MultiLogger(MetricLogger):
    """Fan-out to several sinks; a failing sink is logged (rate-limited) and the others carry on."""

    def __init__(self, loggers: Iterable[MetricLogger]) -> None:
        self.loggers = [lg for lg in loggers if lg is not None]
        self.failures: dict[int, int] = {}

    def _each(self, method: str, *args: Any) -> None:
        for lg in self.loggers:
            try:
                getattr(lg, method)(*args)
            except Exception as exc:
                n = self.failures.get(id(lg), 0) + 1
                self.failures[id(lg)] = n
                if n == 1 or n % 100 == 0:
                    log.warning("%s.%s failed (%d time%s so far); other sinks continue: %r",
                                type(lg).__name__, method, n, "" if n == 1 else "s", exc)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._each("log", metrics, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._each("log_params", params)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._each("log_artifact", path, artifact_path)

    def close(self, status: str = "FINISHED") -> None:
        _check_status(status)
        self._each("close", status)


def build_loggers(run_dir: str | os.PathLike, *, csv_enabled: bool = True, tensorboard: bool = False,
                  mlflow_tracking_uri: str | None = None, mlflow_experiment: str = "nsa",
                  run_name: str | None = None, params: Mapping[str, Any] | None = None,
                  tags: Mapping[str, str] | None = None, resume_step: int | None = None,
                  mlflow_run_id: str | None = None, strict: bool = False,
                  system_metrics: bool = True) -> MultiLogger:
    """The usual rank-0 sinks: ``run_dir/training.csv``, ``run_dir/tb``, MLflow if a URI is given (with
    MLflow's system metrics, CPU/GPU utilisation and memory every 10 s, unless ``system_metrics=False``).

    A sink that cannot start (mlflow missing, store unreachable) is skipped with a warning unless
    ``strict``: telemetry must not stop a training run.
    """
    run_dir = Path(run_dir)
    sinks: list[MetricLogger] = []
    if csv_enabled:
        sinks.append(CSVLogger(run_dir / "training.csv", resume_step=resume_step))
    if tensorboard:
        sinks.append(TensorBoardLogger(run_dir / "tb"))
    if mlflow_tracking_uri:
        try:
            sinks.append(MLflowLogger(mlflow_tracking_uri, mlflow_experiment, run_name, None,
                                      tags=tags, run_id=mlflow_run_id, system_metrics=system_metrics))
        except Exception as exc:
            if strict:
                raise
            log.warning("MLflow logging disabled: %s", exc)
    multi = MultiLogger(sinks)
    if params:
        multi.log_params(params)
    return multi


def plot_training(csv_path: str | os.PathLike, out_png: str | os.PathLike, *,
                  title: str | None = None) -> Path:
    """Loss and toks/s against step from ``training.csv`` into a PNG (matplotlib, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # OO API: no pyplot, no global backend switch

    with open(csv_path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        header = reader.fieldnames or []
    if "step" not in header or "loss" not in header:
        raise ValueError(f"{csv_path} needs 'step' and 'loss' columns to plot, has {header}")

    def series(col: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in rows:
            try:
                x, y = float(r["step"]), float(r.get(col) or "nan")
            except (TypeError, ValueError):
                continue
            if math.isfinite(x) and math.isfinite(y):
                xs.append(x)
                ys.append(y)
        return xs, ys

    panels = [("loss", "loss")] + ([("toks_per_s", "tokens/s")] if "toks_per_s" in header else [])
    fig = Figure(figsize=(7, 3.2 * len(panels)), tight_layout=True)
    FigureCanvasAgg(fig)
    for i, (col, label) in enumerate(panels):
        ax = fig.add_subplot(len(panels), 1, i + 1)
        ax.plot(*series(col), lw=1.0, label=col)
        if col == "loss" and "val_loss" in header:
            ax.plot(*series("val_loss"), "o-", ms=3, lw=1.0, label="val_loss")
            ax.legend()
        ax.set_ylabel(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out
