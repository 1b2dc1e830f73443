"""MLflow system metrics with every training run (issue 48, item 3): build_loggers' MLflow sink samples
CPU/memory (and GPU with nvidia-ml-py) into the run as ``system/*`` metrics; the switch and MLflow's own
off-switch are honoured, and a monitor that cannot start never stops the sink."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("psutil")

from mlflow import MlflowClient  # noqa: E402

from nsa.telemetry import MLflowLogger, build_loggers  # noqa: E402
from nsa.telemetry import loggers as loggers_mod  # noqa: E402


def _system_keys(uri: str, run_id: str) -> set[str]:
    return {k for k in MlflowClient(uri).get_run(run_id).data.metrics if k.startswith("system/")}


def test_training_sinks_log_system_metrics(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lg = MLflowLogger(uri, "sysm", run_name="r", system_metrics=True, system_metrics_interval=0.2)
    assert lg._monitor is not None
    deadline = time.time() + 20
    while time.time() < deadline and lg._monitor._logging_step < 1:     # one sample published
        time.sleep(0.1)
    lg.log({"loss": 1.0}, 1)
    lg.close()                             # flushes the last samples before the run is terminated
    keys = _system_keys(uri, lg.run_id)
    assert "system/cpu_utilization_percentage" in keys and "system/system_memory_usage_megabytes" in keys, keys
    assert MlflowClient(uri).get_run(lg.run_id).info.status == "FINISHED"
    assert lg._monitor is None             # the sampling thread is gone with the sink


def test_build_loggers_turns_them_on_and_off(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    started = []
    real = loggers_mod.start_system_metrics
    monkeypatch.setattr(loggers_mod, "start_system_metrics",
                        lambda *a, **k: started.append(a) or real(*a, **k))
    multi = build_loggers(tmp_path / "a", csv_enabled=False, mlflow_tracking_uri=uri)
    multi.close()
    assert len(started) == 1               # on by default for training runs
    multi = build_loggers(tmp_path / "b", csv_enabled=False, mlflow_tracking_uri=uri, system_metrics=False)
    multi.close()
    assert len(started) == 1
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")   # MLflow's documented off-switch
    assert real("any-run", uri) is None


def test_a_monitor_that_cannot_start_leaves_the_sink_working(tmp_path, monkeypatch, caplog):
    import mlflow.system_metrics.system_metrics_monitor as smm

    def broken(*a, **k):
        raise ImportError("psutil is not installed")
    monkeypatch.setattr(smm, "SystemMetricsMonitor", broken)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with caplog.at_level("WARNING"):
        lg = MLflowLogger(uri, "sysm", system_metrics=True)
    assert lg._monitor is None and "system metrics off: psutil is not installed" in caplog.text
    lg.log({"loss": 2.0}, 1)
    lg.close()
    assert MlflowClient(uri).get_run(lg.run_id).data.metrics["loss"] == 2.0
