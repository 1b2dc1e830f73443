"""Which worker failures Ray Train retries, and the one line a failed run reports first.

Ray Train 2.60 retries every worker-group error up to ``runtime.max_failures`` times. A restart helps a
killed or preempted worker, a transient hang or a flaky node; it cannot help a user error that fails the
same way again: a run dir or storage that refuses writes (read-only, full, no permission), a corrupt data
shard, too little data for one batch. Those are raised in the worker as ``NotRetried`` carrying their
cause as one line (``not_retried`` wraps the training function), and ``NoRetryForUserErrors`` (the
failure policy the controller runs, installed by ``NsaTorchTrainer``; both in nsa/train/ray_trainer.py,
so that this module imports without Ray) ends the run on them at once.

In the driver ``failure_cause`` turns Ray's ``WorkerGroupError`` (whose own first line is "Training failed
due to worker errors:") into the cause: a NotRetried message, else a stall that ended a worker with no
retries left (read from the heartbeats: ``train.on_stall=restart`` ends a stuck worker with os._exit, so
no exception carries it), else the storage/data cause found in the text (nsa.train.rundir.failure_line).
"""
from __future__ import annotations

import contextlib
import errno
import json
from pathlib import Path
from typing import Any, Iterator, Optional

# errors of the filesystem itself: the next attempt writes to the same place and fails the same way
_STORAGE = {errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied",
            errno.EPERM: "Operation not permitted", errno.ENOSPC: "No space left on device",
            errno.EDQUOT: "Disk quota exceeded"}
_FIX = {errno.ENOSPC: "free space there or point logging.root at a larger disk",
        errno.EDQUOT: "free space there or point logging.root at a larger disk"}


class NotRetried(RuntimeError):
    """A user error raised in a worker: the message is the cause in one line; Ray Train does not retry it."""


def storage_line(e: OSError) -> str:
    """``<cause>: <path> (<fix>)``. A copy's error names the source first (shutil sets filename to the
    source, filename2 to the destination); the destination is the place that is full or read-only."""
    where = e.filename2 or e.filename
    fix = _FIX.get(e.errno, "make it writable or point logging.root elsewhere")
    return f"{_STORAGE.get(e.errno, e.strerror)}: {where} ({fix})" if where else \
        f"{_STORAGE.get(e.errno, e.strerror)} ({fix})"


def user_cause(exc: BaseException) -> Optional[str]:
    """The one-line cause if ``exc`` (or an error in its chain) is a user error a retry cannot fix."""
    from nsa.data.shards import DataError
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, NotRetried):
            return str(e)
        if isinstance(e, OSError) and e.errno in _STORAGE:
            return storage_line(e)
        if isinstance(e, DataError):
            return _data_line(e)
        e = e.__cause__ or e.__context__
    if "DataError: " in str(exc):     # raised in a Ray Data task: wrapped by Ray, the type kept only as text
        return _data_line(exc)
    return None


def _data_line(e: BaseException) -> str:
    # a DataError that crossed a Ray Data task arrives as RayTaskError(DataError): its text is a traceback
    import re
    m = re.search(r"DataError: (.+)", str(e))
    return (m.group(1) if m else str(e).splitlines()[0]).strip()


@contextlib.contextmanager
def not_retried() -> Iterator[None]:
    """Around the worker's training: a user error leaves as NotRetried(cause), everything else as it was."""
    try:
        yield
    except NotRetried:
        raise
    except Exception as exc:
        cause = user_cause(exc)
        if cause is None:
            raise
        raise NotRetried(cause) from exc


def not_retried_failures(error: BaseException) -> list[str]:
    """The NotRetried messages among a WorkerGroupError's worker failures (by rank)."""
    failures = getattr(error, "worker_failures", None) or {}
    return [str(e) for _, e in sorted(failures.items()) if isinstance(e, NotRetried)]


# ------------------------------------------------------------------------------------------ driver side
def _stall_records(run_dir: Path, since: float) -> list[dict[str, Any]]:
    """Stall records that ended a worker in the last attempt of this launch (after its last start)."""
    stalls, last_start = [], since
    for f in sorted(run_dir.glob("heartbeat_rank*.jsonl")):
        try:
            lines = f.read_text().splitlines()
        except OSError:
            continue
        for ln in lines:
            try:
                r = json.loads(ln)
            except ValueError:
                continue
            ts = float(r.get("ts", 0.0))
            if r.get("kind") == "start":
                last_start = max(last_start, ts)
            elif r.get("kind") == "stall" and r.get("exiting") and ts >= since:
                stalls.append({**r, "file": f.name})
    return sorted((r for r in stalls if float(r["ts"]) >= last_start), key=lambda r: r["ts"])


def stall_line(run_dir: Path, cfg: Any, since: float) -> Optional[str]:
    """The stall that ended a worker during this launch (train.on_stall=restart/halt), naming the retries."""
    stalls = _stall_records(Path(run_dir), since)
    if not stalls:
        return None
    r = stalls[-1]
    n = cfg.runtime.max_failures
    retries = "no retry left" if n == 0 else f"all {n} retries used"
    return (f"a stall ended the workers: no step finished for {float(r.get('seconds_since_kick', 0)):.0f} s at "
            f"step {r.get('step')} ({r['file']}; train.stall_seconds={cfg.train.stall_seconds:g}, "
            f"train.on_stall={cfg.train.on_stall}) and runtime.max_failures={n} leaves {retries}: raise "
            "runtime.max_failures to restart from the last checkpoint, or find the hang in the stackdump_*_stall.txt "
            "of the run dir")


def failure_cause(error: BaseException, run_dir: Path, cfg: Any, since: float = 0.0) -> str:
    """The first line of a failed fit: the cause, never Ray's 'Training failed due to worker errors:'."""
    from nsa.train.rundir import failure_line
    mine = not_retried_failures(error)
    if mine:
        return mine[0]
    cf = getattr(error, "controller_failure", None)   # Ray's own first line says only "controller error:"
    if cf is not None and not user_cause(error):
        return f"Ray Train's controller failed: {failure_line(cf)}"
    return stall_line(run_dir, cfg, since) or user_cause(error) or failure_line(error)

