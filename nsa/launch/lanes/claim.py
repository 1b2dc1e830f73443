"""A grid owns its folder ``<logging.root>/<grid id>`` and, through it, its lanes' runs and its MLflow parent
run: taken in the driver before Ray starts, held until the grid ends.

- another live grid (or run) of the same name under the same root: refused, naming its pid and host;
- a folder left by an earlier grid, finished or not: refused, because the second grid would rewrite its
  lane results, summary, figures and MLflow runs; ``--overwrite`` first moves it aside
  (``<grid id>.replaced-<time>``, nothing deleted) and runs the grid afresh.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from nsa.launch.lanes.records import read_json
from nsa.launch.lanes.schema import LaneError
from nsa.launch.cli import UserError
from nsa.launch.owner import FolderBusy, check_place, own

SUMMARY_FILE = "lanes_summary.json"


def claim_grid(grid_id: str, grid_dir: Path, overwrite: bool = False, mlflow_uri: Optional[str] = None) -> Any:
    """Lock ``grid_dir`` for this process and make sure the grid starts on an empty folder. Returns the lock
    (``release()`` it when the grid ends). LaneError (exit 2) names the holder or the earlier grid."""
    try:
        check_place(grid_dir.parent, grid_id, mlflow_uri, name_field="--name")
    except UserError as e:
        raise LaneError(str(e)) from None
    try:
        lock = own(grid_dir, f"--name {grid_id}: the grid folder", "wait for that grid to end (or stop it) or "
                   "choose another --name")
    except FolderBusy as e:
        raise LaneError(str(e)) from None
    try:
        if grid_dir.is_dir() and any(grid_dir.iterdir()):
            summary = read_json(grid_dir / SUMMARY_FILE)
            what = (f"a finished grid ({SUMMARY_FILE}, exit code {summary.get('exit_code')})"
                    if isinstance(summary, dict) else "an earlier grid that did not finish")
            if not overwrite:
                raise LaneError(f"--name {grid_id}: {grid_dir} holds {what}, which a second grid would rewrite: "
                                "choose another --name, or pass --overwrite to move it aside and run again")
            aside = grid_dir.with_name(f"{grid_dir.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
            grid_dir.rename(aside)
            print(f"note: --overwrite: moved {what} aside to {aside}", flush=True)
    except BaseException:
        lock.release()
        raise
    return lock
