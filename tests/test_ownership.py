"""Issue 46, items 3, 4, 6 and 8: a lane grid owns its folder (and so its MLflow parent run), one
prepare_data.py owns its --out, names are checked before anything starts, and the smaller bad inputs are one
line with exit 2. Every case here is refused before Ray (``connect_ray`` fails the test if reached); a second
live launch is played by a lock this test process holds (flock locks exclude each other per open file)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import PIPELINES, REPO, load_entry_point, tiny_overrides
from nsa.launch.lanes import cli as lanes_cli
from nsa.train.rundir import RunLock

LONG = "a" * 250
ODD_NAMES = [LONG, "run-🚀-ünï", "a\nb", "sp ace"]


@pytest.fixture()
def no_ray(monkeypatch):
    from nsa.launch import builder

    def refuse(cfg):
        raise AssertionError("connect_ray reached: the launch should have been refused before Ray starts")
    monkeypatch.setattr(builder, "connect_ray", refuse)


def _one_line(err: str, prefix: str = "error:") -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, err
    return lines[0]


def _grid(tiny_data: Path, root: Path, *args: str) -> int:
    return lanes_cli.main(["--only", "baseline", "--steps", "2", *args,
                           *tiny_overrides(tiny_data, root, logging__mlflow=True)])


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------ 3: grids
def test_second_grid_while_the_first_runs_is_refused_naming_it(no_ray, tiny_data, tmp_path, capsys):
    root = tmp_path / "runs"
    held = RunLock(root / "gsame").acquire()         # the first grid, alive
    try:
        assert _grid(tiny_data, root, "--name", "gsame") == 2
    finally:
        held.release()
    line = _one_line(capsys.readouterr().err)
    assert "--name gsame" in line and f"pid {os.getpid()}" in line and "choose another --name" in line, line
    assert not (root / "gsame").exists()


def test_finished_grid_is_never_rewritten_without_overwrite(no_ray, tiny_data, tmp_path, capsys, monkeypatch):
    root = tmp_path / "runs"
    first = root / "gsame"
    (first / "baseline").mkdir(parents=True)
    (first / "lanes_summary.json").write_text(json.dumps({"grid": "gsame", "exit_code": 0}))
    (first / "baseline" / "lane_result.json").write_text(json.dumps({"status": "COMPLETED"}))
    before = _tree(first)
    assert _grid(tiny_data, root, "--name", "gsame") == 2
    line = _one_line(capsys.readouterr().err)
    assert "finished grid" in line and "--overwrite" in line, line
    assert _tree(first) == before

    # --overwrite: the earlier grid is moved aside whole, before Ray; the lock is given back when the grid ends
    from nsa.launch import builder

    class Reached(Exception):
        pass

    def reached(cfg):
        raise Reached
    monkeypatch.setattr(builder, "connect_ray", reached)
    with pytest.raises(Reached):
        _grid(tiny_data, root, "--name", "gsame", "--overwrite")
    aside = [d for d in root.iterdir() if d.name.startswith("gsame.replaced-")]
    assert len(aside) == 1 and _tree(aside[0]) == before
    assert not first.exists() or not any(first.iterdir())
    RunLock(first).acquire().release()


@pytest.mark.parametrize("name", ODD_NAMES + ["mlflow.db"])
def test_bad_grid_names_exit_2_before_anything(no_ray, tiny_data, tmp_path, capsys, name):
    root = tmp_path / "runs"
    assert _grid(tiny_data, root, "--name", name) == 2
    line = _one_line(capsys.readouterr().err)
    assert "--name" in line, line
    if name == LONG:
        assert "250 bytes long: the limit is 128 bytes" in line, line
    assert not root.exists() or not any(p.is_dir() for p in root.iterdir())


# ------------------------------------------------------------------------------------------ 4: data folders
def _prepare(capsys, *args: str) -> tuple[int, str]:
    code = load_entry_point(PIPELINES / "prepare_data.py").main([*args, "--no-progress"])
    return code, capsys.readouterr().err


def test_second_prepare_into_the_same_out_is_refused(tmp_path, capsys):
    out = tmp_path / "data" / "d"
    held = RunLock(out).acquire()                    # the first prepare_data.py, writing
    try:
        code, err = _prepare(capsys, "--out", str(out), "--max-bytes", "100000")
    finally:
        held.release()
    line = _one_line(err, "prepare_data: error:")
    assert code == 2 and f"pid {os.getpid()}" in line and "--out" in line, line
    assert not out.exists()


def test_auto_prepare_of_a_folder_being_built_is_refused(tmp_path):
    from nsa.launch import builder
    from nsa.launch.cli import UserError
    out = tmp_path / "offline"
    held = RunLock(out).acquire()
    try:
        with pytest.raises(UserError, match=f"data.path {out} is in use by pid {os.getpid()}"):
            builder.prepare_local_corpus(out)
    finally:
        held.release()
    assert not out.exists()


def test_out_inside_the_package_is_refused(capsys):
    target = REPO / "nsa" / "shards_here"
    code, err = _prepare(capsys, "--out", str(target), "--max-bytes", "100000")
    line = _one_line(err, "prepare_data: error:")
    assert code == 2 and "inside the nsa package" in line, line
    assert not target.exists()


# ------------------------------------------------------------------------------------------ 6: run names
@pytest.mark.parametrize("name", ODD_NAMES)
def test_bad_run_names_exit_2_before_anything(run_train, tiny_data, tmp_path, name):
    code, err, _ = run_train(*tiny_overrides(tiny_data, tmp_path / "runs"), f"logging.name={name}")
    line = _one_line(err)
    assert code == 2 and "logging.name" in line, line
    if name == LONG:
        assert "250 bytes long: the limit is 128 bytes" in line, line
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ 8: smaller
@pytest.mark.parametrize("args, flag", [(["--max-docs", "0"], "--max-docs=0 must be >= 1"),
                                        (["--val-docs", "-1"], "--val-docs=-1 must be >= 0"),
                                        (["--count-tokenizer", "gpt2"], "--count-tokenizer gpt2"),
                                        (["--storage-root", "relroot"], "--storage-root=relroot must be an absolute")])
def test_prepare_data_bad_flags_exit_2_in_one_line(tmp_path, capsys, args, flag):
    code, err = _prepare(capsys, "--out", str(tmp_path / "d"), *args)
    assert code == 2 and flag in _one_line(err, "prepare_data: error:"), err
    assert not (tmp_path / "d").exists()


def test_generate_warns_about_retired_variables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("NSA_PREFILL_BATCHED", "1")
    with pytest.raises(Exception):     # no checkpoint there: the warning comes first
        load_entry_point(PIPELINES / "generate.py").main(["--checkpoint", str(tmp_path / "none")])
    assert "warning: NSA_PREFILL_BATCHED is retired and ignored" in capsys.readouterr().err


def test_logging_root_that_is_a_file(run_train, tiny_data, tmp_path):
    f = tmp_path / "afile"
    f.write_text("x")
    code, err, _ = run_train(*tiny_overrides(tiny_data, f))
    line = _one_line(err)
    assert code == 2 and "logging.root=" in line and "is a file, not a directory" in line, line
    assert f.read_text() == "x"


@pytest.mark.parametrize("store_exists", [False, True])
def test_run_named_like_the_mlflow_store(run_train, tiny_data, tmp_path, store_exists):
    root = tmp_path / "runs"
    if store_exists:
        root.mkdir()
        (root / "mlflow.db").write_bytes(b"SQLite format 3\x00")
    code, err, _ = run_train(*tiny_overrides(tiny_data, root), "logging.mlflow=true", "logging.name=mlflow.db")
    line = _one_line(err)
    assert code == 2 and "logging.name=mlflow.db" in line and "MLflow store" in line, line
    assert not store_exists or (root / "mlflow.db").read_bytes() == b"SQLite format 3\x00"


def test_run_name_rules_in_the_config():
    """The YAML profile path too: a newline (which the command line's YAML folds away) and the limit itself."""
    from nsa.config import RUN_NAME_MAX_BYTES, ConfigError, check_run_name
    assert check_run_name("x" * RUN_NAME_MAX_BYTES) and check_run_name("lane.repeat+a=b@c,d_e-f")
    for bad in ("a\nb", "ab\n", "x" * (RUN_NAME_MAX_BYTES + 1), "é", "a:b"):
        with pytest.raises(ConfigError, match="logging.name"):
            check_run_name(bad)
