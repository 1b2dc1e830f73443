"""Where an evaluation goes: ``<run dir>/eval/eval_step_<step>.json`` + its passkey heat map, and MLflow.

One file pair per checkpoint step: a second evaluation of the same step is refused unless the caller asks
to replace it, and then each file is replaced atomically (temp file, rename), so a crash leaves the old
evaluation or the new one. In MLflow the results join the training run (``mlflow_run.json`` in the run
dir) as ``eval/*`` metrics at the checkpoint's step, with the JSON and plot as artifacts under
``eval/step_<step>``; a run without an MLflow run gets a new run in its experiment, named after it.
Promotion (nsa.evaluation.registry) reads these files back with ``read_eval``.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

FORMAT = "nsa-eval/1"
EVAL_DIR = "eval"
_CKPT_DIR = re.compile(r"^checkpoint_\d+$")


def run_dir_of(checkpoint_file: Path) -> Path:
    """The run directory a checkpoint file belongs to (its checkpoint dir's parent), else its own dir."""
    d = Path(checkpoint_file).resolve().parent
    return d.parent if _CKPT_DIR.match(d.name) else d


def eval_paths(out_dir: Path, step: int) -> tuple[Path, Path]:
    return out_dir / f"eval_step_{step:08d}.json", out_dir / f"passkey_step_{step:08d}.png"


def check_writable(json_path: Path, overwrite: bool) -> None:
    """Refuse (before any work) to replace an earlier evaluation of the same step unless asked."""
    if json_path.exists() and not overwrite:
        raise FileExistsError(f"--overwrite: {json_path} holds an earlier evaluation of this checkpoint: "
                              "pass --overwrite to replace it (atomically) or --out DIR to keep both")


def write_eval_json(path: Path, results: Mapping[str, Any]) -> Path:
    from nsa.fileio import atomic_write_text
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(path, json.dumps(results, indent=2))


def read_eval(path: Path) -> dict[str, Any]:
    """An evaluation JSON written by pipelines/evaluate.py; ValueError naming the file if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a readable evaluation JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not an evaluation of pipelines/evaluate.py (format {FORMAT})")
    return data


# ------------------------------------------------------------------------------------------ MLflow
def stored_mlflow_run(run_dir: Path) -> dict[str, Any]:
    """The training run's ``mlflow_run.json`` ({} when the run logged no MLflow run)."""
    from nsa.train.reporting import MLFLOW_RUN_FILE
    f = Path(run_dir) / MLFLOW_RUN_FILE
    try:
        data = json.loads(f.read_text()) if f.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def mlflow_target(run_dir: Path, cfg: Any, uri: Optional[str] = None) -> tuple[str, Optional[str], str]:
    """(tracking URI, training run id or None, experiment): the flag's URI, else the run's stored one,
    else the config's logging.mlflow_uri, else ``<runs root>/mlflow.db`` (train.py's default)."""
    stored = stored_mlflow_run(run_dir)
    experiment = stored.get("experiment") or cfg.logging.experiment
    if uri:
        same = stored.get("tracking_uri") == uri
        return uri, stored.get("run_id") if same else None, experiment
    if stored.get("tracking_uri"):
        return stored["tracking_uri"], stored.get("run_id"), experiment
    if cfg.logging.mlflow_uri:
        return cfg.logging.mlflow_uri, None, experiment
    return f"sqlite:///{(Path(run_dir).resolve().parent / 'mlflow.db')}", None, experiment


def eval_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """``eval/val_bpb`` (default length), ``eval/val_bpb_L<n>``, ``eval/passkey_acc_L<n>`` (mean over
    depths) and ``eval/passkey_acc_L<n>_d<percent>`` from an evaluation dict."""
    out: dict[str, float] = {}
    if results.get("val_bpb") is not None:
        out["eval/val_bpb"] = float(results["val_bpb"])
    for row in results.get("bpb", []):
        out[f"eval/val_bpb_L{row['length']}"] = float(row["bpb"])
    pk = results.get("passkey") or {}
    for n, acc in (pk.get("accuracy_by_length") or {}).items():
        out[f"eval/passkey_acc_L{n}"] = float(acc)
    for c in pk.get("cells", []):
        out[f"eval/passkey_acc_L{c['length']}_d{round(100 * c['depth'])}"] = float(c["accuracy"])
    return out


class EvalRun:
    """The MLflow run an evaluation is logged to: the training run if it exists in the store, else a new
    run in the experiment (closed FINISHED by ``close``; the training run's status is left alone)."""

    def __init__(self, uri: str, experiment: str, run_id: Optional[str], run_name: str,
                 tags: Mapping[str, str]) -> None:
        from mlflow import MlflowClient
        from nsa.telemetry.loggers import ensure_local_store
        ensure_local_store(uri)
        self.client, self.uri, self._logger = MlflowClient(uri), uri, None
        self.note = ""
        if run_id:
            try:
                self.client.get_run(run_id)
            except Exception:   # a store that was moved or cleared: a new run keeps the results
                self.note = f"the run's MLflow run {run_id} is not in {uri}; logged to a new run"
                run_id = None
        if run_id is None:
            from nsa.telemetry.loggers import MLflowLogger   # its experiment creation (artifact root)
            self._logger = MLflowLogger(uri, experiment, run_name=run_name, tags=dict(tags))
            run_id = self._logger.run_id
        self.run_id = run_id
        self.new = self._logger is not None

    def log(self, metrics: Mapping[str, float], step: int, files: list[Path], artifact_path: str) -> None:
        from mlflow.entities import Metric
        import time
        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), ts, int(step)) for k, v in metrics.items()])
        for f in files:
            self.client.log_artifact(self.run_id, str(f), artifact_path)

    def close(self, status: str = "FINISHED") -> None:
        if self._logger is not None:
            self._logger.close(status)
