"""pipelines/promote.py (issue 48, item 3): a registry round trip in a temporary SQLite MLflow store. A better
and a worse tiny checkpoint are evaluated; the better one is registered and takes @champion, the worse one is
registered but refused with the reason, re-running registers nothing twice, and the champion loads back as a
pyfunc model that continues a prompt as TinyLM.generate does. decide() covers the incomparable cases."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("mlflow")

from conftest import PIPELINES, load_entry_point  # noqa: E402
from evaltools import tiny_cfg, train_checkpoint, write_data  # noqa: E402
from nsa.launch.cli import UserError  # noqa: E402

EVAL = load_entry_point(PIPELINES / "evaluate.py")
PROMOTE = load_entry_point(PIPELINES / "promote.py")


def _evaluate(run_dir, uri):
    assert EVAL.main(["--checkpoint", str(run_dir), "--no-passkey", "--lengths", "32", "--max-tokens", "256",
                      "--mlflow-uri", uri]) == 0
    return json.loads(next((run_dir / "eval").glob("eval_step_*.json")).read_text())["val_bpb"]


def test_register_promote_and_refuse_a_worse_model(tmp_path, capsys, monkeypatch):
    import mlflow
    from mlflow import MlflowClient
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    data = write_data(tmp_path / "data")
    runs = tmp_path / "runs"
    uri = f"sqlite:///{runs / 'mlflow.db'}"
    good, bad = runs / "good", runs / "bad"
    train_checkpoint(good, tiny_cfg(data), steps=40)
    train_checkpoint(bad, tiny_cfg(data), steps=2)
    with pytest.raises(UserError, match=r"^--eval: no evaluation of step 40 .*evaluate\.py --checkpoint"):
        PROMOTE.main([str(good), "--mlflow-uri", uri])
    good_bpb, bad_bpb = _evaluate(good, uri), _evaluate(bad, uri)
    assert good_bpb < bad_bpb

    assert PROMOTE.main([str(good), "--promote", "--mlflow-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "registered: eval-test version 1" in out and "promoted: eval-test version 1 is now @champion" in out
    client = MlflowClient(uri)
    champ = client.get_model_version_by_alias("eval-test", "champion")
    assert str(champ.version) == "1" and float(champ.tags["val_bpb"]) == pytest.approx(good_bpb)
    assert champ.tags["checkpoint_step"] == "40" and champ.tags["attention"] == "nsa"

    assert PROMOTE.main([str(bad), "--promote", "--mlflow-uri", uri]) == PROMOTE.EXIT_REFUSED
    out = capsys.readouterr().out
    assert "registered: eval-test version 2" in out
    assert f"not promoted: val bits/byte {bad_bpb:.4f} does not beat @champion (version 1: {good_bpb:.4f})" in out
    assert str(client.get_model_version_by_alias("eval-test", "champion").version) == "1"

    assert PROMOTE.main([str(good), "--promote", "--mlflow-uri", uri]) == PROMOTE.EXIT_REFUSED
    out = capsys.readouterr().out
    assert "already registered: eval-test version 1" in out and "already holds @champion" in out
    assert len(client.search_model_versions("name='eval-test'")) == 2

    # the champion as a model: its artifacts and what it predicts
    model_uri = "models:/eval-test@champion"
    mlflow.set_tracking_uri(uri)
    loaded = mlflow.pyfunc.load_model(model_uri)
    got = loaded.predict(["def f("], params={"max_new_tokens": 6})
    from nsa.evaluation.core import build_model
    from nsa.train.checkpoint import load_checkpoint
    state = load_checkpoint(good)
    want = build_model(state["config"], state["model"]).generate(torch.tensor([list(b"def f(")]), 6)[0, 6:]
    assert got == [bytes(want.tolist()).decode("utf-8", errors="replace")]
    local = mlflow.artifacts.download_artifacts(model_uri, dst_path=str(tmp_path / "dl"))
    ev = json.loads(next(Path(local).rglob("eval_step_00000040.json")).read_text())
    assert ev["val_bpb"] == pytest.approx(good_bpb)
    assert json.loads(next(Path(local).rglob("tokenizer.json")).read_text())["name"] == "byte"


def _version(v, **tags):
    return SimpleNamespace(version=str(v), tags=tags)


def test_decide_refuses_what_cannot_be_compared():
    from nsa.evaluation.registry import decide
    base = dict(val_bpb="2.0", eval_length="256", val_fingerprint="abc", eval_max_tokens="65536")
    cand = _version(2, **{**base, "val_bpb": "1.5"})
    assert decide(cand, None, "champion").promote
    assert decide(cand, _version(1, **base), "champion").promote
    other = decide(cand, _version(1, **{**base, "val_fingerprint": "xyz"}), "champion")
    assert not other.promote and "another val split" in other.reason
    longer = decide(cand, _version(1, **{**base, "eval_length": "1024"}), "champion")
    assert not longer.promote and "another length (256 vs 1024)" in longer.reason
    hand = decide(cand, _version(1), "champion")
    assert not hand.promote and "no val_bpb tag" in hand.reason
    tie = decide(_version(2, **base), _version(1, **base), "champion")
    assert not tie.promote and "does not beat" in tie.reason            # equal is not better
