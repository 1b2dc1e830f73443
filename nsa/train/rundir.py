"""The run directory's guarantees: one live launch owns it, files in it are replaced atomically, and a
failure says its cause in one line.

    lock = RunLock(run_dir).acquire()     # before anything in the run dir is written; RunLocked if taken
    atomic_write_text(run_dir / "config.yaml", text)
    ...
    lock.release()                        # also released by the OS when the process dies

The lock is ``flock(LOCK_EX | LOCK_NB)`` on ``<run dir>/.lock``. The kernel drops it when the holder's
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
import socket
import time
from pathlib import Path
from typing import Any, Optional

from nsa.config import check_run_name

LOCK_FILE = ".lock"


class RunLocked(RuntimeError):
    """Another live launch owns the run directory; the message names its pid and host."""


# ------------------------------------------------------------------------------------------ names
def run_dir_under(root: str | os.PathLike, name: str) -> Path:
    """``root/name`` resolved, refusing a name that (through a symlink) lands outside ``root``."""
    check_run_name(name)          # ConfigError (a ValueError) naming logging.name
    root_p = Path(root).expanduser().resolve()
    d = (root_p / name).resolve()
    if d.parent != root_p:
        raise ValueError(f"logging.name={name!r} resolves to {d}, outside logging.root={root_p}: "
                         "choose a name that is not a symlink leading elsewhere")
    return d


# ------------------------------------------------------------------------------------------ atomic files
def fsync_dir(d: str | os.PathLike) -> None:
    """Make a rename/creation in ``d`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(d), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temp file beside ``path``, fsync it, rename it over ``path``, fsync the dir.
    Readers see the old file or the new one, never a part; a failed write (ENOSPC) leaves the old one."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(p.parent)
    return p


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


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
        self.path = self.run_dir / LOCK_FILE
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
        self.run_dir.mkdir(parents=True, exist_ok=True)
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


def failure_line(exc: BaseException) -> str:
    """First line of a failed run's report: the storage cause if there is one, else the error's first line."""
    cause = storage_cause(exc)
    if cause:
        return cause
    first = next((ln for ln in str(exc).splitlines() if ln.strip()), "")
    return f"{type(exc).__name__}: {first[:400]}" if first else type(exc).__name__
