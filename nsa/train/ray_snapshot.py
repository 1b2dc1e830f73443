"""Ray Train's list of a run's checkpoints (``checkpoint_manager_snapshot.json`` in the run dir) made to agree
with the project's verified scan of the run dir (nsa/train/checkpoint.py), the one source of truth.

Ray keeps its own list: on a relaunch by name its controller dies (``CheckpointManagerInitializationError``)
if an entry no longer exists (set aside as incomplete, deleted by hand), hands the workers its own "latest"
(which lags the disk when the driver died before registering the newest), and prunes (``num_to_keep``)
only what it registered. So before Ray starts, and after it ends, the driver rewrites the snapshot to list
exactly the run's complete checkpoints in step order, the newest complete one as latest: Ray resumes
from what the project verified, and its pruning then covers every checkpoint of the run.

The file is written with Ray's own schema classes (same Ray version, so Ray's version check passes); a
Ray whose internals moved gets no snapshot at all instead (moved aside), which Ray reads as "no
checkpoints": the workers' scan of the run dir still resumes from the newest complete one
(nsa/train/loop.py), and the driver's pruning still covers the old ones.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from nsa.fileio import atomic_write_text
from nsa.train.checkpoint import list_checkpoints

SNAPSHOT = "checkpoint_manager_snapshot.json"


def _old_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def _entries(state: dict[str, Any]) -> tuple[dict[str, dict], dict[str, int], Optional[str]]:
    """(dir name -> metrics, dir name -> report index, latest dir name) of an old snapshot, as far as it parses."""
    metrics, index = {}, {}
    results = state.get("checkpoint_results") or []
    indices = state.get("checkpoint_report_indices") or []
    for i, r in enumerate(results if isinstance(results, list) else []):
        if isinstance(r, dict) and isinstance(r.get("checkpoint_dir_name"), str):
            metrics[r["checkpoint_dir_name"]] = r.get("metrics") if isinstance(r.get("metrics"), dict) else {}
            if isinstance(indices, list) and i < len(indices) and type(indices[i]) is int:
                index[r["checkpoint_dir_name"]] = indices[i]
    latest = state.get("latest_checkpoint_result")
    return metrics, index, latest.get("checkpoint_dir_name") if isinstance(latest, dict) else None


def sync_snapshot(run_dir: str | os.PathLike) -> Optional[str]:
    """Rewrite ``run_dir``'s Ray snapshot to list the complete checkpoints (oldest first, newest = latest).
    No snapshot and no checkpoint: nothing written. Returns a one-line note when Ray's list disagreed
    with the run dir, else None."""
    run_dir = Path(run_dir)
    path = run_dir / SNAPSHOT
    good = list_checkpoints(run_dir)
    if not good and not path.exists():
        return None
    old = _old_state(path)
    metrics, index, old_latest = _entries(old)
    names = [d.name for _, d in good]
    if set(metrics) == set(names) and old_latest == (names[-1] if names else None) \
            and old.get("ray_version") == _ray_version() and not old.get("pending_training_results"):
        return None                                   # Ray's list is the run dir's already
    try:
        text = _snapshot_json(good, metrics, index, old.get("current_report_index"))
    except (ImportError, AttributeError, TypeError, ValueError) as e:   # Ray's internals moved: Ray starts empty
        if path.exists():
            moved = path.with_name(f".{SNAPSHOT}.unusable-{int(time.time() * 1000)}")
            os.replace(path, moved)
            return (f"note: Ray's checkpoint list moved aside as {moved.name} ({type(e).__name__}); the workers "
                    f"resume from the newest complete checkpoint of the run dir")
        return None
    atomic_write_text(path, text)
    said = old_latest or "none"
    now = names[-1] if names else "none"
    return (f"note: Ray's checkpoint list (latest {said}, {len(metrics)} entries) rewritten to the run dir's "
            f"complete checkpoints (latest {now}, {len(names)} entries)")


def _ray_version() -> Optional[str]:
    try:
        import ray
        return ray.__version__
    except ImportError:
        return None


def _snapshot_json(good: list[tuple[int, Path]], metrics: dict[str, dict], index: dict[str, int],
                   current: Any) -> str:
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (_CheckpointManagerState,
                                                                                 _TrainingResultState)
    results, indices, last = [], [], -1
    for step, d in good:
        results.append(_TrainingResultState(checkpoint_dir_name=d.name, metrics=metrics.get(d.name) or {"step": step}))
        last = max(last + 1, index.get(d.name, -1))    # report order follows step order
        indices.append(last)
    state = _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=indices,
        latest_checkpoint_result=results[-1] if results else None,
        pending_training_results=[], pending_validation_specs=[],
        current_report_index=max(last + 1, current if type(current) is int else 0),
        validated_checkpoint_dir_names=[], timed_out_validation_checkpoint_dir_names=[],
        failed_validation_checkpoint_dir_names=[])
    # Ray writes it with .json() (pydantic v1 API, deprecated under v2): the same text either way
    return state.model_dump_json() if hasattr(state, "model_dump_json") else state.json()
