"""Metric sinks: CSV, TensorBoard, MLflow (tmp SQLite store), fan-out isolation, plot."""
from __future__ import annotations

import csv
import logging
import math

import pytest

from nsa.telemetry import (CSVLogger, MetricLogger, MLflowLogger, MultiLogger, TensorBoardLogger, build_loggers,
                           flatten_params, plot_training)


def _rows(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def test_csv_logger_widens_header_and_resumes(tmp_path):
    path = tmp_path / "run" / "training.csv"
    lg = CSVLogger(path, fields=["loss", "lr"])
    lg.log({"loss": 5.5, "lr": 1e-3}, step=1)
    lg.log({"loss": 5.0, "lr": 1e-3, "gate/L0/entropy": 1.05}, step=2)  # new column appears
    lg.log({"loss": float("nan"), "toks_per_s": 400}, step=3)
    lg.close()
    header, rows = _rows(path)
    assert header == ["step", "loss", "lr", "gate/L0/entropy", "toks_per_s"]
    assert [r["step"] for r in rows] == ["1", "2", "3"]
    assert rows[0]["gate/L0/entropy"] == "" and float(rows[1]["gate/L0/entropy"]) == 1.05
    assert math.isnan(float(rows[2]["loss"])) and rows[2]["lr"] == "" and rows[2]["toks_per_s"] == "400"
    assert float(rows[0]["lr"]) == 1e-3  # full precision round trip

    # resume after a crash at step 3 from a checkpoint of step 2: rows > 2 are dropped, then appended
    lg2 = CSVLogger(path, resume_step=2)
    assert lg2.columns == header
    lg2.log({"loss": 4.9}, step=3)
    lg2.close()
    header2, rows2 = _rows(path)
    assert header2 == header and [r["step"] for r in rows2] == ["1", "2", "3"]
    assert float(rows2[2]["loss"]) == 4.9


def test_multilogger_isolates_failing_sink(tmp_path, caplog):
    class Broken(MetricLogger):
        def log(self, metrics, step):
            raise RuntimeError("disk full")

    good = CSVLogger(tmp_path / "t.csv")
    multi = MultiLogger([Broken(), good])
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            multi.log({"loss": 1.0 / (step + 1)}, step)
    multi.close()
    _, rows = _rows(tmp_path / "t.csv")
    assert len(rows) == 3
    assert "Broken.log failed" in caplog.text and "disk full" in caplog.text
    assert caplog.text.count("Broken.log failed") == 1  # rate-limited, not once per step
    assert sorted(multi.failures.values()) == [3]


def test_tensorboard_logger_writes_events(tmp_path):
    tb = TensorBoardLogger(tmp_path / "tb")
    if not tb.enabled:
        pytest.skip("tensorboard not installed")
    tb.log({"loss": 2.0, "note": "text is skipped"}, step=1)
    tb.log_params({"model": {"dim": 64}})
    tb.close()
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())


def test_flatten_params():
    flat = flatten_params({"model": {"dim": 64, "nsa": {"l": 32}}, "tags": [1, 2], "lr": 1e-3})
    assert flat == {"model.dim": "64", "model.nsa.l": "32", "tags": "[1, 2]", "lr": "0.001"}


def test_mlflow_logger_sqlite(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # sqlite:////abs/path
    assert uri.startswith("sqlite:////")
    params = {"model": {"dim": 64, "n_layers": 2}, "long": "x" * 10000}
    lg = MLflowLogger(uri, "nsa-test", run_name="lane-a", params=params, tags={"lane": "a"})
    lg.log({"loss": 3.0, "gate/L0/entropy": 1.0, "weird key!": 1.0}, step=1)
    lg.log({"loss": 2.5, "gate/L0/entropy": 0.9}, step=2)
    art = tmp_path / "curve.txt"
    art.write_text("hello")
    lg.log_artifact(art)
    lg.close()

    client = MlflowClient(uri)
    run = client.get_run(lg.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "lane-a"
    assert run.data.tags["lane"] == "a"
    assert run.data.params["model.dim"] == "64" and run.data.params["model.n_layers"] == "2"
    long = run.data.params["long"]
    assert len(long) <= 6000 and long.endswith("[truncated]")
    history = client.get_metric_history(lg.run_id, "loss")
    assert [(m.step, m.value) for m in sorted(history, key=lambda m: m.step)] == [(1, 3.0), (2, 2.5)]
    assert run.data.metrics["gate/L0/entropy"] == 0.9 and "weird key_" in run.data.metrics
    assert [a.path for a in client.list_artifacts(lg.run_id)] == ["curve.txt"]
    exp = client.get_experiment(lg.experiment_id)
    assert exp.name == "nsa-test" and str(tmp_path) in exp.artifact_location  # beside the DB, not the cwd

    # a second run reuses the experiment; failing inside the context marks it FAILED
    with pytest.raises(RuntimeError):
        with MLflowLogger(uri, "nsa-test", run_name="lane-b") as lg2:
            raise RuntimeError("diverged")
    assert lg2.experiment_id == lg.experiment_id
    assert client.get_run(lg2.run_id).info.status == "FAILED"
    # asynchronous batches are all stored by the time close() returns
    lg3 = MLflowLogger(uri, "nsa-test", run_name="lane-c", synchronous=False)
    for step in range(20):
        lg3.log({"loss": 1.0 / (step + 1)}, step)
    lg3.close()
    assert len(client.get_metric_history(lg3.run_id, "loss")) == 20
    # continuing a run by id (a resumed job) appends to the same run
    lg4 = MLflowLogger(uri, "nsa-test", run_id=lg3.run_id)
    lg4.log({"loss": 0.01}, 20)
    lg4.close()
    assert len(client.get_metric_history(lg3.run_id, "loss")) == 21
    with pytest.raises(ValueError, match="tracking_uri"):
        MLflowLogger("", "x")


def test_default_experiment_artifacts_beside_the_store(tmp_path, monkeypatch):
    """The process that creates the store runs elsewhere (a Ray worker's cwd is in Ray's temp dir): every
    experiment's artifacts, MLflow's Default included, still live under the store's folder."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from nsa.telemetry.loggers import ensure_local_store

    store_dir, elsewhere = tmp_path / "runs", tmp_path / "ray_tmp" / "working_dir"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    uri = f"sqlite:///{store_dir / 'mlflow.db'}"
    lg = MLflowLogger(uri, "nsa")
    lg.close()
    client = MlflowClient(uri)
    locations = {e.name: e.artifact_location for e in client.search_experiments()}
    assert set(locations) == {"Default", "nsa"}
    for name, loc in locations.items():
        assert loc.startswith((store_dir / "mlartifacts").as_uri() + "/"), (name, loc)
    assert not any(elsewhere.iterdir())
    # an existing store is left as it is (its experiments keep their locations)
    ensure_local_store(uri)
    assert {e.name: e.artifact_location for e in client.search_experiments()} == locations


def test_build_loggers_skips_broken_mlflow(tmp_path, caplog):
    pytest.importorskip("mlflow")
    with caplog.at_level(logging.WARNING):
        multi = build_loggers(tmp_path, mlflow_tracking_uri="bogus://nowhere", params={"a": {"b": 1}})
    assert [type(lg).__name__ for lg in multi.loggers] == ["CSVLogger"]
    assert "MLflow logging disabled" in caplog.text
    multi.log({"loss": 1.0}, 1)
    multi.close()
    assert _rows(tmp_path / "training.csv")[1][0]["loss"] == "1.0"
    with pytest.raises(Exception):
        build_loggers(tmp_path / "strict", csv_enabled=False, mlflow_tracking_uri="bogus://nowhere", strict=True)


def test_plot_training(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "training.csv"
    lg = CSVLogger(path)
    for step in range(1, 21):
        lg.log({"loss": 5.0 / step, "toks_per_s": 400 + step}, step)
    lg.close()
    out = plot_training(path, tmp_path / "plots" / "training.png", title="run")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="loss"):
        plot_training(bad, tmp_path / "x.png")
