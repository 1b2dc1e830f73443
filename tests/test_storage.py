"""runtime.storage_root and Ray's working-dir copy (nsa/launch/storage.py), without Ray: results of a job
never land in the copy that `ray job submit --working-dir .` unpacks, and relative paths follow the root."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, TINY_PROFILE, load_entry_point, tiny_overrides
from nsa.config import ConfigError, resolve_config
from nsa.launch import builder
from nsa.launch.cli import UserError
from nsa.launch.storage import apply_storage, job_copy, prepare_out, run_root, working_dir_copy
from nsa.train.rundir import release_run


def _copy(tmp: Path) -> Path:
    """A directory shaped like Ray's working-dir copy of a job."""
    pkg = tmp / "ray" / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    (pkg / "pipelines").mkdir(parents=True)
    return pkg


def _cfg(**kw: object):
    overrides = [f"{k.replace('__', '.')}={v}" for k, v in kw.items()]
    return resolve_config(TINY_PROFILE, overrides, env={})[0]


def test_working_dir_copy_detection(tmp_path):
    pkg = _copy(tmp_path)
    assert working_dir_copy(pkg / "runs" / "x") == pkg
    assert working_dir_copy(pkg) == pkg
    assert working_dir_copy(tmp_path / "runtime_resources") is None
    assert working_dir_copy(tmp_path / "runs") is None
    assert job_copy(pkg, script="x.py") == pkg                                  # the working directory
    assert job_copy(tmp_path, script=str(pkg / "pipelines" / "prod_50k.py")) == pkg   # or the entry script
    assert job_copy(tmp_path, script=str(REPO / "pipelines" / "prod_50k.py")) is None


def test_job_copy_refuses_relative_results_naming_fields_and_fix(tmp_path):
    pkg = _copy(tmp_path)
    cfg = _cfg(data__path="data/fineweb_edu")          # missing: the user would prepare it in the copy
    with pytest.raises(UserError) as e:
        apply_storage(cfg, cwd=pkg)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"logging.root='runs' -> {pkg.resolve()}/runs" in msg
    assert "data.path='data/fineweb_edu'" in msg and "working-dir copy" in msg
    assert "runtime.storage_root=/mnt/shared" in msg and "NSA_STORAGE_ROOT" in msg
    # an absolute path into the copy is the same loss
    cfg = _cfg(logging__root=str(pkg / "out"), data__source="synthetic")
    with pytest.raises(UserError, match=r"logging.root=.* inside Ray's working-dir copy"):
        apply_storage(cfg, cwd=pkg)
    # the default sqlite store lives under logging.root; a relative one of its own is refused too
    cfg = _cfg(logging__root=str(tmp_path / "keep"), logging__mlflow_uri="sqlite:///mlflow.db",
               data__source="synthetic")
    with pytest.raises(UserError, match="logging.mlflow_uri"):
        apply_storage(cfg, cwd=pkg)


def test_data_uploaded_with_the_copy_may_be_read(tmp_path, tiny_data):
    pkg = _copy(tmp_path)
    shutil.copytree(tiny_data, pkg / "data" / "tiny")
    cfg = _cfg(data__path="data/tiny", logging__root=str(tmp_path / "runs"))
    apply_storage(cfg, cwd=pkg)
    assert cfg.data.path == str((pkg / "data" / "tiny").resolve())
    assert cfg.logging.root == str((tmp_path / "runs").resolve())


def test_storage_root_resolves_relative_paths(tmp_path, tiny_data):
    pkg, shared = _copy(tmp_path), tmp_path / "shared"
    shutil.copytree(tiny_data, shared / "data" / "tiny")
    cfg = _cfg(runtime__storage_root=str(shared), data__path="data/tiny", data__val_path="data/tiny",
               logging__mlflow_uri="sqlite:///mlflow/m.db", train__resume_from="runs/r/checkpoint_00000002")
    apply_storage(cfg, cwd=pkg)
    shared = shared.resolve()
    assert cfg.logging.root == str(shared / "runs")
    assert cfg.data.path == cfg.data.val_path == str(shared / "data" / "tiny")
    assert cfg.logging.mlflow_uri == f"sqlite:///{shared}/mlflow/m.db"
    assert cfg.train.resume_from == str(shared / "runs" / "r" / "checkpoint_00000002")
    assert run_root(_cfg(runtime__storage_root=str(shared))) == shared / "runs"
    # absolute paths and server URIs are kept
    cfg = _cfg(runtime__storage_root=str(shared), logging__root=str(tmp_path / "elsewhere"), data__source="synthetic",
               logging__mlflow_uri="http://head:5000")
    apply_storage(cfg, cwd=pkg)
    assert cfg.logging.root == str((tmp_path / "elsewhere").resolve())
    assert cfg.logging.mlflow_uri == "http://head:5000"
    # outside a copy and without a root: relative to the working directory, as before
    cfg = _cfg(data__source="synthetic")
    apply_storage(cfg, cwd=tmp_path)
    assert cfg.logging.root == str(tmp_path.resolve() / "runs")


def test_storage_root_must_be_an_existing_absolute_directory(tmp_path):
    with pytest.raises(ConfigError, match="runtime.storage_root='shared' must be an absolute path"):
        _cfg(runtime__storage_root="shared")
    cfg = _cfg(runtime__storage_root=str(tmp_path / "not-mounted"), data__source="synthetic")
    with pytest.raises(UserError, match="runtime.storage_root=.*not-mounted is not a directory"):
        apply_storage(cfg, cwd=tmp_path)
    assert not (tmp_path / "not-mounted").exists()


def test_env_names_the_storage_root(tmp_path):
    cfg, sources = resolve_config(TINY_PROFILE, [], env={"NSA_STORAGE_ROOT": str(tmp_path)})
    assert cfg.runtime.storage_root == str(tmp_path) and sources["runtime.storage_root"] == "env"
    cfg, _ = resolve_config(TINY_PROFILE, ["runtime.storage_root=null"], env={"NSA_STORAGE_ROOT": str(tmp_path)})
    assert cfg.runtime.storage_root is None                                      # the command line wins


def test_validate_inputs_puts_the_run_under_the_storage_root(tmp_path, tiny_data, monkeypatch):
    """The builder's hook: a job started in a copy with the root set writes its run dir under the root."""
    pkg, shared = _copy(tmp_path), tmp_path / "shared"
    shutil.copytree(tiny_data, shared / "data" / "tiny")
    monkeypatch.chdir(pkg)
    cfg, sources = resolve_config(TINY_PROFILE, tiny_overrides(Path("data/tiny"), Path("runs"), logging__name="r",
                                                                 logging__mlflow=True),
                                  env={"NSA_STORAGE_ROOT": str(shared)})
    builder.validate_inputs(cfg)
    run_dir = builder.prepare_run(cfg, sources)
    release_run(run_dir)
    assert run_dir == shared.resolve() / "runs" / "r" and (run_dir / "config.yaml").is_file()
    assert builder.mlflow_uri(cfg) == f"sqlite:///{shared.resolve()}/runs/mlflow.db"
    assert sorted(p.name for p in pkg.iterdir()) == ["pipelines"]                # nothing written in the copy
    cfg, _ = resolve_config(TINY_PROFILE, tiny_overrides(Path("data/tiny"), Path("runs")), env={})
    with pytest.raises(UserError, match="logging.root='runs'"):
        builder.validate_inputs(cfg)


def test_prepare_data_out_follows_the_rule(tmp_path, capsys):
    pkg, shared = _copy(tmp_path), tmp_path / "shared"
    shared.mkdir()
    assert prepare_out("data/fw", str(shared), cwd=pkg) == shared.resolve() / "data" / "fw"
    with pytest.raises(UserError, match=r"--out='data/fw' -> .*inside Ray's working-dir copy.*--storage-root"):
        prepare_out("data/fw", None, cwd=pkg)
    cli = load_entry_point(REPO / "pipelines" / "prepare_data.py")
    assert cli.main(["--storage-root", str(shared), "--out", "data/fw", "--max-docs", "6", "--val-docs", "1",
                     "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["out"] == str(shared.resolve() / "data" / "fw") and summary["train_docs"] == 5
