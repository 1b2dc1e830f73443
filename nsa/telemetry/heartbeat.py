"""Per-rank heartbeat: one JSON object per line in ``run_dir/heartbeat_rank{rank}.jsonl``.

The heartbeat is the first thing an operator tails when a run looks stuck (seeds 000/004): the last
record says where the loop was (``step_start`` without ``step_end`` = stalled inside the step;
``step_end`` without the next ``step_start`` = stalled at the step boundary). So every line is
flushed as it is written, and a record is never split across lines even when several threads write
(the loop, the watchdog thread).

Record layout: ``{"ts": unix float, "iso": UTC ISO-8601, "kind", "step", "rank", "pid", **fields}``.
Non-finite floats are written as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` so every
line is strict JSON (``jq`` reads it); :func:`read_heartbeat` turns them back into floats.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

# The kinds the trainer writes (the heartbeat accepts any non-empty string; these are the agreed ones).
KIND_ATTEMPT = "attempt"   # a worker entered its loop (before it reads data or builds the model)
KIND_START = "start"
KIND_STEP_START = "step_start"
KIND_PROGRESS = "progress"
KIND_STEP_END = "step_end"
KIND_STALL = "stall"
KIND_HALT = "halt"
KIND_ANOMALY = "anomaly"
KIND_CHECKPOINT = "checkpoint"
KIND_EVAL = "eval"
KIND_END = "end"
KINDS = frozenset({KIND_ATTEMPT, KIND_START, KIND_STEP_START, KIND_PROGRESS, KIND_STEP_END, KIND_STALL, KIND_HALT,
                   KIND_ANOMALY, KIND_CHECKPOINT, KIND_EVAL, KIND_END})

RESERVED_KEYS = frozenset({"ts", "iso", "kind", "step", "rank", "pid"})
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def heartbeat_path(run_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` writes its heartbeat."""
    return Path(run_dir) / f"heartbeat_rank{int(rank)}.jsonl"


def _jsonable(value: Any) -> Any:
    """Make ``value`` strict-JSON: non-finite floats -> strings, numpy/torch scalars -> Python."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    tolist = getattr(value, "tolist", None)  # numpy scalars/arrays; tensors (caller's sync, not ours)
    if callable(tolist):
        return _jsonable(tolist())
    return str(value)


class Heartbeat:
    """Append-only JSONL heartbeat of one rank. Thread-safe; every line is flushed when written.

    ``Heartbeat(run_dir, rank).write("step_end", step, loss=2.3, toks_per_s=410.0)``.
    ``enabled=False`` makes every call a no-op (the loop keeps one code path).
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int = 0, *, enabled: bool = True) -> None:
        if int(rank) < 0:
            raise ValueError(f"rank must be >= 0, got {rank!r}")
        self.run_dir = Path(run_dir)
        self.rank = int(rank)
        self.enabled = bool(enabled)
        self.path = heartbeat_path(self.run_dir, self.rank)
        self._lock = threading.Lock()
        self._fh = None
        self.last_record: dict[str, Any] | None = None
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # buffering=1: line-buffered text file; we still flush explicitly after each record.
            self._fh = open(self.path, "a", buffering=1, encoding="utf-8")

    def write(self, kind: str, step: int, **fields: Any) -> dict[str, Any]:
        """Append one record and flush it. Returns the record as written (before JSON escaping)."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"kind must be a non-empty string such as 'step_end', got {kind!r}")
        clash = RESERVED_KEYS.intersection(fields)
        if clash:
            raise ValueError(f"heartbeat fields {sorted(clash)} are reserved; rename them "
                             f"(reserved: {sorted(RESERVED_KEYS)})")
        try:
            step_i = int(step)
        except (TypeError, ValueError):
            raise ValueError(f"step must be an integer, got {step!r}") from None
        now = time.time()
        record: dict[str, Any] = {
            "ts": now,
            "iso": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="milliseconds"),
            "kind": kind, "step": step_i, "rank": self.rank, "pid": os.getpid(),
        }
        record.update(fields)
        if not self.enabled:
            return record
        line = json.dumps(_jsonable(record), allow_nan=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self._fh is None:
                raise ValueError(f"heartbeat {self.path} is closed; create a new Heartbeat to write")
            self._fh.write(line)
            self._fh.flush()
            self.last_record = record
        return record

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Heartbeat(path={str(self.path)!r}, enabled={self.enabled})"


def _restore_nonfinite(value: Any) -> Any:
    if isinstance(value, str) and value in _NONFINITE:
        return _NONFINITE[value]
    if isinstance(value, dict):
        return {k: _restore_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore_nonfinite(v) for v in value]
    return value


def iter_heartbeat(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Yield the records of a heartbeat file; skips unparsable lines (e.g. a torn last line)."""
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                yield _restore_nonfinite(rec)


def read_heartbeat(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of one heartbeat file (see :func:`iter_heartbeat`)."""
    return list(iter_heartbeat(path))
