"""One launch owns a folder it writes: a lane grid its grid folder (whose summary, figures and MLflow parent
run it writes at the end), ``prepare_data.py`` its ``--out``. The lock is the run directory's
(nsa/train/rundir.py ``RunLock``: ``flock`` on ``<parent>/.<name>.lock``, dropped by the kernel however the
holder ends), so a grid and a training run of the same name under one root also exclude each other.

    lock = own(grid_dir, "grid folder", "wait for it to end or choose another --name")   # FolderBusy if taken
    ...
    lock.release()
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional


class FolderBusy(FileExistsError):
    """Another live process owns the folder; the message names it (pid, host, since, command) and the fix."""


def holder(lock_file: Path) -> str:
    """The process recorded in a lock file, in words."""
    try:
        h = json.loads(lock_file.read_text() or "{}")
    except (OSError, ValueError):
        h = {}
    if not isinstance(h, dict) or not h:
        return "an unknown process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
    return f"pid {h.get('pid')} on host {h.get('host')} (since {since}: {h.get('argv', '?')})"


def own(folder: str | os.PathLike, what: str, fix: str):
    """Take ``folder``'s lock for this process (a ``RunLock``; ``release()`` it, or let the process end).
    Raises FolderBusy: ``<what> <folder> is in use by <holder>: <fix>``. Creates only the lock file."""
    from nsa.train.rundir import RunLock, RunLocked
    lock = RunLock(Path(folder))
    try:
        return lock.acquire()
    except RunLocked:
        raise FolderBusy(f"{what} {folder} is in use by {holder(lock.path)}: {fix}") from None


def _store_names(root: Path, mlflow_uri: Optional[str]) -> set[str]:
    """Names the local MLflow store uses in ``root`` (nsa/telemetry/loggers.py ensure_local_store)."""
    if not mlflow_uri or not mlflow_uri.startswith("sqlite:///"):
        return set()
    db = Path(mlflow_uri[len("sqlite:///"):]).expanduser().resolve()
    if db.parent != root:
        return set()
    return {db.name, f"{db.name}-journal", f"{db.name}-wal", f"{db.name}-shm", "mlartifacts"}


def check_place(root: str | os.PathLike, name: Optional[str], mlflow_uri: Optional[str], *,
                root_field: str = "logging.root", name_field: str = "logging.name") -> None:
    """Before anything is created: ``root`` is (or can become) a directory, and ``root/name`` is neither a
    file nor the MLflow store beside the runs. UserError naming the field and the fix."""
    from nsa.launch.cli import UserError
    root = Path(root).expanduser().resolve()
    p = root
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise UserError(f"{root_field}={root}: {p} is a file, not a directory: point {root_field} at a directory "
                        "(a new one is created)")
    if name is None:
        return
    if name in _store_names(root, mlflow_uri):
        raise UserError(f"{name_field}={name} is the name of the MLflow store's file or folder in {root_field} "
                        f"{root}: choose another {name_field}")
    if (root / name).exists() and not (root / name).is_dir():
        raise UserError(f"{name_field}={name}: {root / name} is a file, not a run folder: choose another {name_field}")
