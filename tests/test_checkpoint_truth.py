"""One source of truth for a run's checkpoints (issue 46, items 1-2): the project's verified scan of the run dir
decides what a relaunch resumes from, Ray's checkpoint_manager_snapshot.json is rewritten to agree before Ray
starts (an entry set aside or deleted no longer kills Ray's controller), an edited meta.json is an incomplete
checkpoint rather than a traceback, and pruning to train.keep_checkpoints covers every checkpoint of the run,
whoever registered it. The Ray tests resume on the tiny CPU profile (1 worker) and compare losses step by step
with an uninterrupted run."""
from __future__ import annotations

import csv
import json
import shutil

import pytest

from conftest import TINY_PROFILE, tiny_overrides
from nsa.train.checkpoint import CKPT_FILE, META_FILE, checkpoint_problem, list_checkpoints, prune_checkpoints
from nsa.train.ray_snapshot import SNAPSHOT, sync_snapshot
from nsa.train.rundir import release_run


def _ckpt(run_dir, step):
    from test_pipeline_cli import _ckpt as make      # a small real checkpoint (1 layer x 32)
    return make(run_dir, f"checkpoint_{step:08d}", step)


def _steps(run_dir):
    return [s for s, _ in list_checkpoints(run_dir)]


# ---------------------------------------------------------------------------------------------- no Ray
@pytest.mark.parametrize("files", [{CKPT_FILE: "abc"}, [CKPT_FILE], {CKPT_FILE: True}, {"../x": 1}, None])
def test_meta_files_of_the_wrong_type_is_an_incomplete_checkpoint(tmp_path, capsys, files):
    from test_reliability import _small_cfg
    from nsa.launch import builder
    run = tmp_path / "r"
    _ckpt(run, 3)
    meta = run / "checkpoint_00000005" / META_FILE
    _ckpt(run, 5)
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "files": files}))
    assert "'files' is not a map of file name to byte count" in checkpoint_problem(meta.parent)
    cfg = _small_cfg(tmp_path)
    rd = builder.prepare_run(cfg, commit=False)
    try:
        out = capsys.readouterr().out
        assert "skipping checkpoint_00000005: meta.json 'files' is not a map" in out
        assert "continuing from step 3 (checkpoint_00000003)" in out
        builder.commit_prepared(rd, cfg)
        assert _steps(rd) == [3] and [p for p in rd.iterdir() if p.name.startswith(".incomplete-checkpoint_00000005")]
    finally:
        release_run(rd)


def test_prune_keeps_the_newest_and_the_protected_and_leaves_partials(tmp_path):
    run = tmp_path / "r"
    for step in range(1, 6):
        _ckpt(run, step)
    partial = run / "checkpoint_00000006"
    partial.mkdir()
    (partial / CKPT_FILE).write_bytes(b"half")                 # no meta.json: incomplete, kept for inspection
    (run / ".pruning-checkpoint_00000000-1").mkdir()            # a prune that died mid-delete
    gone = prune_checkpoints(run, 2, protect=(run / "checkpoint_00000001",))
    assert [d.name for d in gone] == ["checkpoint_00000002", "checkpoint_00000003"]
    assert _steps(run) == [1, 4, 5] and partial.is_dir()
    assert not [p for p in run.iterdir() if p.name.startswith(".pruning-")]
    assert prune_checkpoints(run, 0) and _steps(run) == [5]    # keep < 1 still keeps the newest complete one


def _ray_manager(root, name, keep=3):
    from ray.train import CheckpointConfig
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    return CheckpointManager(CheckpointConfig(num_to_keep=keep), StorageContext(str(root), name))


def test_ray_loads_the_rewritten_snapshot_and_resumes_from_the_newest_complete(tmp_path):
    """Ray's own CheckpointManager (what its controller builds on a relaunch by name) dies on a snapshot
    naming a deleted checkpoint; after sync_snapshot it loads and its latest is the newest complete one."""
    from ray.train.v2._internal.exceptions import CheckpointManagerInitializationError
    run = tmp_path / "r"
    for step in (1, 2, 3):
        _ckpt(run, step)
    assert sync_snapshot(run) and _ray_manager(tmp_path, "r").latest_checkpoint_result.checkpoint.path.endswith(
        "checkpoint_00000003")
    shutil.rmtree(run / "checkpoint_00000003")
    with pytest.raises(CheckpointManagerInitializationError, match="does not exist"):
        _ray_manager(tmp_path, "r")                          # the failure of issue 46 item 1
    note = sync_snapshot(run)
    assert "latest checkpoint_00000003, 3 entries" in note and "latest checkpoint_00000002, 2 entries" in note
    mgr = _ray_manager(tmp_path, "r")
    assert mgr.latest_checkpoint_result.checkpoint.path.endswith("checkpoint_00000002")
    assert [r.checkpoint.path.rsplit("/", 1)[1] for r in mgr.best_checkpoint_results] == \
        ["checkpoint_00000001", "checkpoint_00000002"]
    assert sync_snapshot(run) is None                        # already in agreement: not rewritten


# ---------------------------------------------------------------------------------------------- Ray
STEPS = 6


def _launch(data, root, name, **kw):
    from nsa.config import resolve_config
    from nsa.launch import builder
    kw = {"train__steps": STEPS, "train__save_every": 1, "train__eval_every": 0, "train__keep_checkpoints": 3,
          "runtime__num_workers": 1, "logging__name": name, **kw}
    cfg, src = resolve_config(TINY_PROFILE, tiny_overrides(data, root, **kw))
    return builder.launch(cfg, src, prefix="truth")


def _losses(run_dir):
    with open(run_dir / "training.csv", newline="") as fh:
        return {int(r["step"]): r["loss"] for r in csv.DictReader(fh)}


def _ray_list(run_dir):
    snap = json.loads((run_dir / SNAPSHOT).read_text())
    return [r["checkpoint_dir_name"] for r in snap["checkpoint_results"]], snap["latest_checkpoint_result"][
        "checkpoint_dir_name"]


@pytest.fixture(scope="module")
def runs(ray_session, tiny_data, tmp_path_factory):
    """An uninterrupted run and one halted after step 3 (checkpoints 1-3, all registered by Ray)."""
    root = tmp_path_factory.mktemp("truth")
    ref = _launch(tiny_data, root, "ref")
    halted = _launch(tiny_data, root, "h", runtime__fault="halt@3")
    assert ref.exit_code == 0 and halted.summary["status"] == "halted", (ref.summary, halted.summary)
    assert _ray_list(halted.run_dir) == ([f"checkpoint_{s:08d}" for s in (1, 2, 3)], "checkpoint_00000003")
    (halted.run_dir / ".HALT").unlink(missing_ok=True)
    return root, _losses(ref.run_dir), halted.run_dir


def _meta_size(d):
    meta = json.loads((d / META_FILE).read_text())
    meta["files"][CKPT_FILE] += 1
    (d / META_FILE).write_text(json.dumps(meta))


@pytest.mark.ray
# a truncated checkpoint.pt takes the same path as a wrong size in meta.json (both set aside): unit-tested in
# tests/test_reliability.py, so the Ray launches cover the two ways the snapshot goes stale
@pytest.mark.parametrize("damage", [_meta_size, shutil.rmtree], ids=["meta_size", "deleted"])
def test_relaunch_resumes_from_the_newest_complete_whatever_rays_snapshot_says(runs, tiny_data, capsys, damage):
    root, ref, halted = runs
    name = f"copy_{damage.__name__}"
    run = shutil.copytree(halted, root / name)               # a copy of the run, its newest checkpoint damaged
    damage(run / "checkpoint_00000003")
    capsys.readouterr()
    out = _launch(tiny_data, root, name)
    text = capsys.readouterr().out
    assert out.exit_code == 0 and out.summary["status"] == "completed", text
    assert out.summary["start_step"] == 2 and "continuing from step 2 (checkpoint_00000002)" in text
    assert "Ray's checkpoint list (latest checkpoint_00000003, 3 entries) rewritten" in text
    assert "CheckpointManagerInitializationError" not in text and "resume with" not in text
    got = _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(3, STEPS + 1):
        assert got[step] == ref[step], step                  # bit-identical continuation
    assert _steps(run) == [4, 5, 6]
    assert _ray_list(run) == ([f"checkpoint_{s:08d}" for s in (4, 5, 6)], "checkpoint_00000006")


@pytest.mark.ray
def test_pruning_covers_checkpoints_ray_never_registered(runs, tiny_data, capsys):
    """A driver killed before Ray registered checkpoints 2-3 (its snapshot lists 1 only), then a worker group
    SIGKILLed right after saving 4: every checkpoint of the run counts for train.keep_checkpoints=2."""
    root, ref, halted = runs
    run = shutil.copytree(halted, root / "pruned")
    snap = json.loads((run / SNAPSHOT).read_text())
    snap["checkpoint_results"], snap["checkpoint_report_indices"] = snap["checkpoint_results"][:1], [0]
    snap["latest_checkpoint_result"] = snap["checkpoint_results"][0]
    (run / SNAPSHOT).write_text(json.dumps(snap))
    capsys.readouterr()
    out = _launch(tiny_data, root, "pruned", train__keep_checkpoints=2, runtime__fault="kill@5",
                  runtime__max_failures=1)
    text = capsys.readouterr().out
    assert out.exit_code == 0 and out.summary["status"] == "completed", text
    assert "note: pruned checkpoint_00000001 (train.keep_checkpoints=2" in text   # before Ray started
    assert "continuing from step 3 (checkpoint_00000003)" in text
    got = _losses(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(4, STEPS + 1):
        assert got[step] == ref[step], step
    assert _steps(run) == [5, 6] and not [p for p in run.iterdir() if "checkpoint_0" in p.name and p.name[0] == "."]
    assert _ray_list(run) == (["checkpoint_00000005", "checkpoint_00000006"], "checkpoint_00000006")
