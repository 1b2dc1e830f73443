"""The run directory's guarantees: one live launch owns it, files in it are replaced atomically, and a
failure says its cause in one line.

    lock = RunLock(run_dir).acquire()     # before anything in the run dir is written; RunLocked if taken
    atomic_write_text(run_dir / "config.yaml", text)
    ...
    lock.release()                        # also released by the OS when the process dies

The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<logging.root>/.<name>.lock``, beside the run dir rather
than in it, so taking it changes nothing inside an existing run. The kernel drops it when the holder's
process ends, however it ends, so a crashed launch never blocks the next one; the holder's pid, host and
start time are written into the file, so a second launch can name the holder, and a file that still
names a holder but is not locked is reported as the stale lock of a launch that died. On shared storage
(``logging.root`` on NFS for a multi-node cluster) ``flock`` is only as good as the filesystem's lock
service: NFSv4 provides it; a filesystem without one makes the lock advisory per node.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from nsa.config import ConfigError, check_run_name
from nsa.fileio import atomic_write_bytes, atomic_write_text, fsync_dir  # noqa: F401  (re-exported)
from nsa.train.checkpoint import prune_checkpoints, scan_checkpoints, set_aside, verify_checkpoint

def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


class RunLocked(FileExistsError):
    """Another live launch owns the run directory; the message names its pid and host."""


# ------------------------------------------------------------------------------------------ names
def run_dir_under(root: str | os.PathLike, name: str) -> Path:
    """``root/name`` resolved, refusing a name that (through a symlink) lands outside ``root``."""
    check_run_name(name)          # ConfigError (a ValueError) naming logging.name
    root_p = Path(root).expanduser().resolve()
    d = (root_p / name).resolve()
    if d.parent != root_p:
        raise ConfigError(f"logging.name={name!r} resolves to {d}, outside logging.root={root_p}: "
                         "choose a name that is not a symlink leading elsewhere")
    return d


# ------------------------------------------------------------------------------------------ lock
def _holder(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def _describe(h: dict[str, Any]) -> str:
    if not h:
        return "an unknown process"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
    return f"pid {h.get('pid')} on host {h.get('host')} (since {since}, {h.get('argv', '?')})"


class RunLock:
    """Exclusive ownership of a run directory by one process (see module doc)."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.run_dir = Path(run_dir)
        self.path = lock_path(self.run_dir)
        self._fd: Optional[int] = None
        self.stale: Optional[str] = None     # set by acquire() when it took over a dead launch's lock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "RunLock":
        import fcntl
        import sys
        if self._fd is not None:
            return self
        self.run_dir.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLocked(f"run dir {self.run_dir} is in use by {_describe(_holder(self.path))}: wait for "
                                "it to end, stop it (touch <run dir>/.HALT), or choose another logging.name") from None
            raise
        prev = _holder(self.path)
        if prev:   # a holder recorded but no lock held: that launch died without releasing it
            self.stale = (f"took over the stale lock of {_describe(prev)}, which ended without releasing it "
                          "(killed or crashed)")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                "argv": " ".join(sys.argv[:1] + [a for a in sys.argv[1:] if "=" in a][:6])[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        import fcntl
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:   # an empty file = released cleanly; the file itself stays (unlinking races with a new holder)
            os.ftruncate(fd, 0)
        except OSError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


# ------------------------------------------------------------------------------------------ failures
_CAUSES = {errno.ENOSPC: "No space left on device", errno.EROFS: "Read-only file system",
           errno.EDQUOT: "Disk quota exceeded", errno.EACCES: "Permission denied",
           errno.EFBIG: "File too large", errno.EIO: "Input/output error"}
_ERRNO_RE = re.compile(r"\[Errno (\d+)\] ([^\n:'\"]+)(?:: '([^'\n]+)')?")


def storage_cause(exc: BaseException) -> Optional[str]:
    """The storage error behind ``exc`` as one line (``No space left on device: /runs/r/x``), found in its
    cause chain or, for errors that crossed a process boundary as text (Ray's TrainingFailedError
    carries the worker's traceback as a string), in its message. None if it is not a storage error."""
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _CAUSES:
            where = f": {e.filename}" if e.filename else ""
            return f"{_CAUSES[e.errno]}{where}"
        e = e.__cause__ or e.__context__
    texts = [str(exc)] + [str(getattr(exc, a)) for a in ("worker_failures", "controller_failure")
                          if getattr(exc, a, None)]
    for text in texts:
        for m in _ERRNO_RE.finditer(text):
            if int(m.group(1)) in _CAUSES:
                return _CAUSES[int(m.group(1))] + (f": {m.group(3)}" if m.group(3) else "")
    return None


_DATA_RE = re.compile(r"DataError: (.+)")


def failure_line(exc: BaseException) -> str:
    """First line of a failed run's report: the storage cause if there is one, else a data error naming
    the shard (raised in a worker, carried as text), else the error's first line."""
    cause = storage_cause(exc)
    if cause:
        return cause
    m = _DATA_RE.search(str(exc))
    if m:
        return m.group(1).strip()
    first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first[:400]}" if first else type(exc).__name__


# ------------------------------------------------------------------------------------------ claim / commit
@dataclass
class RunClaim:
    """A run directory this process owns, and what a launch there will do (nothing written yet)."""
    run_dir: Path
    lock: RunLock
    resume_file: Optional[Path] = None        # the newest complete checkpoint, if the run has one
    resume_step: Optional[int] = None
    incomplete: list[tuple[Path, str]] = field(default_factory=list)   # partial checkpoint dirs, with why
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        self.lock.release()


_HELD: dict[Path, RunClaim] = {}     # run dirs this process owns (a launch holds its claim until it ends)


def claim_run(root: str | os.PathLike, name: str, *, resume: str = "auto") -> RunClaim:
    """Lock ``root/name`` and find the checkpoint a launch there continues from. Writes nothing but the
    lock file. Raises RunLocked (another live launch owns it), ConfigError (bad name, train.resume=never
    on a run with checkpoints) or CheckpointError (the newest complete checkpoint does not load)."""
    run_dir = run_dir_under(root, name)
    held = _HELD.get(run_dir)
    claim = RunClaim(run_dir, held.lock if held else RunLock(run_dir).acquire())
    _HELD[run_dir] = claim
    try:
        if claim.lock.stale and not held:
            claim.notes.append(f"run lock: {claim.lock.stale}")
        good, claim.incomplete = scan_checkpoints(run_dir)
        newer = [(d, why) for d, why in claim.incomplete if not good or _dir_step(d) > good[-1][0]]
        if good and resume == "never":
            raise ConfigError(f"run dir {run_dir} already has checkpoints (latest step {good[-1][0]}) and "
                              "train.resume=never: choose another logging.name or set train.resume=auto")
        for d, why in newer:
            claim.notes.append(f"resume: skipping {d.name}: {why}")
        if good:
            claim.resume_file, claim.resume_step = verify_checkpoint(good[-1][1])  # corrupt -> names the file
        elif claim.incomplete:
            claim.notes.append("resume: no complete checkpoint: the run starts from step 0")
    except BaseException:
        release_run(run_dir)
        raise
    return claim


def _dir_step(d: Path) -> int:
    m = re.match(r"^checkpoint_(\d+)$", d.name)
    return int(m.group(1)) if m else -1


def commit_run(run_dir: str | os.PathLike, config_text: str, keep: Optional[int] = None) -> list[str]:
    """After every check passed: set incomplete checkpoint dirs aside, prune complete ones beyond the newest
    ``keep`` (train.keep_checkpoints; never the one resumed from), make Ray's checkpoint list the run dir's
    (``settle_checkpoints``), move a stale ``.HALT`` aside, and write config.yaml atomically, in the run dir
    this process claimed. Returns what it did, one line each."""
    run_dir = Path(run_dir).resolve()
    claim = _HELD.get(run_dir)
    if claim is None or not claim.lock.held:
        raise RuntimeError(f"commit_run({run_dir}) without claim_run: the run dir is not locked by this process")
    done = []
    run_dir.mkdir(parents=True, exist_ok=True)
    for d, why in claim.incomplete:
        if d.exists():
            done.append(f"note: set the incomplete {d.name} ({why}) aside as {set_aside(d).name}; delete it to "
                        "free its space")
    from nsa.train.fsdp import STAGING_GLOB
    for left in sorted(run_dir.glob(STAGING_GLOB)):      # a sharded save cut short: never a checkpoint
        shutil.rmtree(left, ignore_errors=True)
        done.append(f"note: removed {left.name}, the staging dir of a sharded checkpoint save that was cut short")
    done += settle_checkpoints(run_dir, keep, protect=(claim.resume_file.parent,) if claim.resume_file else ())
    halt = run_dir / ".HALT"
    if halt.exists():
        moved = run_dir / f".HALT.consumed-{int(time.time())}"
        halt.rename(moved)
        done.append(f"note: moved stale {halt.name} of an earlier halt to {moved.name}")
    atomic_write_text(run_dir / "config.yaml", config_text)
    return done


def settle_checkpoints(run_dir: str | os.PathLike, keep: Optional[int], protect: tuple[Path, ...] = ()) -> list[str]:
    """Prune to the newest ``keep`` complete checkpoints (None: keep all) and rewrite Ray's checkpoint list
    to match (nsa/train/ray_snapshot.py). Run by the lock holder while no Ray run uses the dir: before
    fit (commit_run) and after it (a worker group killed before Ray registered its newest checkpoint
    leaves one Ray never prunes). Returns what it did, one line each."""
    from nsa.train.ray_snapshot import sync_snapshot
    done = []
    if keep is not None:
        gone = prune_checkpoints(run_dir, keep, protect)
        if gone:
            done.append(f"note: pruned {', '.join(d.name for d in gone)} (train.keep_checkpoints={keep} keeps the "
                        "newest complete ones)")
    note = sync_snapshot(run_dir)
    return done + ([note] if note else [])


def release_run(run_dir: str | os.PathLike) -> None:
    """Give up this process's lock on ``run_dir`` (no-op if it holds none)."""
    claim = _HELD.pop(Path(run_dir).resolve(), None)
    if claim is not None:
        claim.release()
