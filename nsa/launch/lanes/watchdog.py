"""The grid's hang watchdog: a lane that stalls and does not recover is abandoned so it cannot hold the grid."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Optional

from nsa.launch.lanes.records import first_line, read_heartbeats
from nsa.launch.lanes.tracking import tag_lane_run

SILENCE_FLOOR_S = 600.0   # hang_verdict rule (2) never fires sooner: start-up is silent, minutes on a loaded 2-core box


def hang_verdict(recs: list[dict[str, Any]], grace: float, stall_s: float, since: float, now: float) -> Optional[str]:
    """Whether the grid should give up on a lane, from its heartbeats (oldest first). Hung when (1) the
    worker's watchdog wrote a stall record and no step_end/end followed within ``grace`` s, or (2) no
    heartbeat at all came for ``stall_s + grace`` s (at least SILENCE_FLOOR_S; ``since`` = lane start when
    there is none yet): the watchdog is paused during the first data fetch, so a data deadlock at start-up
    writes no stall record. ``grace`` <= 0 disables both."""
    if grace <= 0:
        return None
    last_ts = recs[-1].get("ts", 0.0) if recs else since
    if now - last_ts > max(stall_s + grace, SILENCE_FLOOR_S):
        where = f"{recs[-1].get('kind')} of step {recs[-1].get('step')}" if recs else "the lane started"
        return (f"hung: no heartbeat for {now - last_ts:.0f}s since {where} (> train.stall_seconds + "
                "--hang-grace), lane ended by the grid")
    stall = next((r for r in reversed(recs) if r.get("kind") == "stall"), None)
    if stall is None or now - stall["ts"] <= grace:
        return None
    if any(r.get("kind") in ("step_end", "end") and r.get("ts", 0.0) > stall["ts"] for r in recs):
        return None
    return f"hung: no step_end {grace:g}s after the watchdog's stall record, lane ended by the grid (--hang-grace)"


def fit_watched(trainer: Any, run_dir: Path, uri: Optional[str], tags: dict[str, str], grace: float,
                stall_s: float) -> Optional[str]:
    """fit() in a thread while this one tags the MLflow run and watches for a hang (then the lane is
    abandoned: the trial's actor exits and takes the lane's controller and workers with it)."""
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # noqa: BLE001 - reported as the lane's error
            box["error"] = e

    th = threading.Thread(target=target, name="lane-fit", daemon=True)
    t0, tagged = time.time(), False
    th.start()
    while th.is_alive():
        th.join(1.0)
        tagged = tagged or tag_lane_run(run_dir, uri, tags)
        try:
            hung = hang_verdict(read_heartbeats(run_dir), grace, stall_s, t0, time.time())
        except OSError:
            hung = None
        if hung:
            return hung
    return first_line(box["error"]) if "error" in box else None
