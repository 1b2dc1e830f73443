"""Atomic file writes: a reader (or a resume after a crash or a full disk) sees the old file or the new
one, never a part. A leaf module: the checkpoint, run-directory, reporting and shard code all use it."""
from __future__ import annotations

import os
from pathlib import Path


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
