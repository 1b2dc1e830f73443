"""pipelines/evaluate.py (issue 48, item 2) on tiny checkpoints written straight from the library: the JSON,
the passkey heat map and the eval/* metrics in the training run's MLflow run (a temporary SQLite store);
the dense twin alike; an earlier evaluation is never replaced silently; bad flags are one line naming the flag;
the passkey prompt and its one-pass scoring agree with greedy decoding."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from conftest import PIPELINES, load_entry_point
from evaltools import tiny_cfg, train_checkpoint, write_data
from nsa.evaluation import core
from nsa.launch.cli import UserError, guarded

CLI = load_entry_point(PIPELINES / "evaluate.py")
FAST = ["--lengths", "32", "64", "--max-tokens", "256", "--trials", "2", "--depths", "0", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("evaldata") / "data")


def test_evaluate_writes_json_plot_and_metrics_into_the_runs_mlflow_run(data, tmp_path, capsys):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from nsa.telemetry import MLflowLogger
    runs = tmp_path / "runs"
    run_dir = runs / "r-nsa"
    train_checkpoint(run_dir, tiny_cfg(data))
    uri = f"sqlite:///{runs / 'mlflow.db'}"
    train = MLflowLogger(uri, "eval-test", run_name="r-nsa")       # what the training run left behind
    train.close()
    (run_dir / "mlflow_run.json").write_text(json.dumps({"run_id": train.run_id, "tracking_uri": uri,
                                                          "experiment": "eval-test"}))
    assert CLI.main(["--checkpoint", str(run_dir), *FAST, "--passkey-lengths", "300"]) == 0
    js, png = run_dir / "eval" / "eval_step_00000003.json", run_dir / "eval" / "passkey_step_00000003.png"
    res = json.loads(js.read_text())
    assert res["step"] == 3 and res["attention"] == "nsa" and res["default_length"] == 32
    assert [r["length"] for r in res["bpb"]] == [32, 64] and res["val_bpb"] == res["bpb"][0]["bpb"]
    assert all(0 < r["bpb"] < 9 and r["bytes"] == r["tokens"] for r in res["bpb"])   # byte tokens, ~random model
    assert res["val"]["files"][0].endswith("val-00000.parquet")                        # held out, not train
    cells = res["passkey"]["cells"]
    assert {(c["length"], c["depth"]) for c in cells} == {(300, 0.0), (300, 1.0)}
    assert all(c["trials"] == 2 and 0 <= c["accuracy"] <= 1 for c in cells)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["mlflow"]["run_id"] == train.run_id and not res["mlflow"]["new_run"]
    client = MlflowClient(uri)
    run = client.get_run(train.run_id)
    assert run.data.metrics["eval/val_bpb"] == pytest.approx(res["val_bpb"])
    assert run.data.metrics["eval/val_bpb_L64"] == pytest.approx(res["bpb"][1]["bpb"])
    assert "eval/passkey_acc_L300_d100" in run.data.metrics and "eval/passkey_acc_L300" in run.data.metrics
    assert client.get_metric_history(train.run_id, "eval/val_bpb")[0].step == 3
    assert run.info.status == "FINISHED"                               # the training run's status untouched
    arts = {a.path for a in client.list_artifacts(train.run_id, "eval/step_00000003")}
    assert arts == {"eval/step_00000003/" + js.name, "eval/step_00000003/" + png.name}
    assert "| depth \\ length | 300 |" in capsys.readouterr().out

    before = js.read_bytes()                                           # a second evaluation of the step
    with pytest.raises(SystemExit) as exc:
        guarded(lambda: CLI.main(["--checkpoint", str(run_dir), *FAST, "--no-mlflow"]))()
    assert exc.value.code == 2 and js.read_bytes() == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--overwrite" in err[0] and str(js) in err[0]


def test_dense_twin_evaluates_and_bad_flags_name_themselves(data, tmp_path):
    run_dir = tmp_path / "runs" / "r-dense"
    train_checkpoint(run_dir, tiny_cfg(data, "dense"))
    args = ["--checkpoint", str(run_dir), "--no-mlflow", "--no-passkey", "--lengths", "32", "--max-tokens", "128"]
    assert CLI.main(args) == 0
    res = json.loads((run_dir / "eval" / "eval_step_00000003.json").read_text())
    assert res["attention"] == "dense" and "passkey" not in res and math.isfinite(res["val_bpb"])
    assert not (run_dir / "eval" / "passkey_step_00000003.png").exists()
    for extra, flag in ((["--depths", "1.5"], "--depths"), (["--passkey-lengths", "40"], "--passkey-lengths"),
                        (["--trials", "0"], "--trials"), (["--lengths", "0"], "--lengths"),
                        (["--lengths", "99999", "--no-passkey"], "--lengths"),
                        (["--data", str(tmp_path / "nowhere")], "--data")):
        with pytest.raises(UserError) as exc:
            CLI.main(["--checkpoint", str(run_dir), "--no-mlflow", "--overwrite", *extra])
        assert str(exc.value).startswith(flag) and "\n" not in str(exc.value), exc.value
    cfg = tiny_cfg(data).model
    with pytest.raises(ValueError, match=r"^--passkey-lengths: length 65536 .* use lengths <= \d+"):
        core.forward_budget(cfg, 1, 65536, torch.device("cpu"), torch.float32, flag="--passkey-lengths",
                            free=64 << 20)


def test_passkey_prompt_layout_and_one_pass_scoring_match_greedy_decoding(data):
    from nsa.data.tokenizers import get_tokenizer
    from nsa.model import TinyLM
    tok = get_tokenizer("byte")
    pre, q = tok.encode(core.PREFIX), tok.encode(core.QUESTION)
    for depth in (0.0, 0.5, 1.0):
        ids, start = core.passkey_prompt(tok, 600, depth, "40417")
        assert len(ids) == 600 and tok.decode(ids[start:]) == "40417" and ids[:len(pre)] == pre
        assert ids[start - len(q):start] == q
        at = tok.decode(ids).index("The pass key is 40417")
        if depth == 0.0:
            assert at == len(pre)                                      # right after the instructions
        if depth == 1.0:
            assert tok.decode(ids)[at:].startswith(core.NEEDLE.format(key="40417") + core.QUESTION)
    with pytest.raises(ValueError, match="--passkey-lengths: 100 is shorter"):
        core.passkey_prompt(tok, 100, 0.5, "40417")
    cfg = tiny_cfg(data)
    torch.manual_seed(0)
    model = TinyLM.from_config(cfg.model, cfg.nsa).eval()
    key = core.random_key(random.Random(1), 5)
    ids, start = core.passkey_prompt(tok, 300, 0.5, key)
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids[:start]]), 5)[0, start:].tolist()
        h = core.hidden_states(model, torch.tensor([ids[:-1]]))
        one_pass = model.lm_head(h[0, start - 1]).argmax(-1).item()    # the position before the key
    assert one_pass == greedy[0]
    cell = core.passkey_cell(model, tok, 300, 0.5, trials=2, seed=3)
    assert cell == core.passkey_cell(model, tok, 300, 0.5, trials=2, seed=3)       # same keys, same result
    assert cell["correct"] == round(cell["accuracy"] * 2)


def test_passkey_table_shows_digits_right_when_no_key_is_retrieved():
    """A model part way to retrieval (every exact cell 0%) shows in the table's digits row: the mean of each
    length's token accuracy over depths, in percent."""
    cells = [{"length": n, "depth": d, "accuracy": acc, "token_accuracy": tok}
             for n, d, acc, tok in [(4096, 0.0, 0.0, 0.35), (4096, 1.0, 0.0, 0.25),
                                    (8192, 0.0, 0.5, 0.6), (8192, 1.0, 0.0, 0.1)]]
    rows = core.passkey_table(cells).splitlines()
    assert rows[0] == "| depth \\ length | 4096 | 8192 |"
    assert rows[2:] == ["| 0 | 0% | 50% |", "| 1 | 0% | 0% |", "| mean | 0% | 25% |", "| digits right | 30% | 35% |"]
