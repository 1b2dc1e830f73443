"""Stall watchdog and stack dumps.

A training "hang" (seed 002: every configuration stopped at step 5) is only debuggable with the stacks
of every thread at the moment it happens. The loop calls ``Watchdog.kick()`` at step boundaries; a
daemon thread calls ``on_stall(seconds_since_kick)`` once per stall episode when no kick arrives
within ``stall_seconds``. :func:`make_stall_handler` builds the handler the trainer passes: it dumps
all stacks to ``run_dir/stackdump_*.txt`` and writes a ``stall`` heartbeat.

For a hard per-run timeout (Ray Tune has none per trial, see docs/ray.md), run a second Watchdog with
a larger ``stall_seconds`` and ``make_stall_handler(..., exit_code=...)``: it records the stall and
ends the process so the lane fails instead of hanging.
"""
from __future__ import annotations

import datetime as _dt
import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from .heartbeat import KIND_STALL, Heartbeat

log = logging.getLogger(__name__)


def _stackdump_name(tag: str = "") -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S_%fZ")
    tag = f"_{tag}" if tag else ""
    return f"stackdump_{stamp}_pid{os.getpid()}{tag}.txt"


def format_thread_stacks() -> str:
    """Python-level stacks of every thread, with thread names (which faulthandler does not print)."""
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        name, daemon = names.get(ident, ("<unknown>", False))
        parts.append(f"--- thread {name!r} ident={ident} daemon={daemon}\n")
        parts.append("".join(traceback.format_stack(frame)))
    return "".join(parts)


def dump_stacks(path: str | os.PathLike, *, reason: str = "") -> Path:
    """Write the stacks of every thread to ``path`` and return the file's path.

    If ``path`` is an existing directory, a new ``stackdump_<utc>_pid<pid>.txt`` is created in it.
    The file holds faulthandler's dump (works even for threads stuck in C code) followed by
    ``sys._current_frames`` formatted with thread names.
    """
    target = Path(path)
    if target.is_dir():
        target = target / _stackdump_name()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w", encoding="utf-8") as fh:
        fh.write(f"# stack dump pid={os.getpid()} time={_dt.datetime.now(_dt.timezone.utc).isoformat()}"
                 f" reason={reason or '-'}\n# --- faulthandler (all threads) ---\n")
        fh.flush()  # faulthandler writes to the file descriptor directly: keep the order
        faulthandler.dump_traceback(file=fh, all_threads=True)
        fh.write("\n# --- sys._current_frames ---\n")
        fh.write(format_thread_stacks())
    return target


class Watchdog:
    """Calls ``on_stall(seconds_since_last_kick)`` once per stall episode.

    An episode starts when ``stall_seconds`` pass without ``kick()``; the next ``kick()`` ends it.
    ``kick()`` only stores a float (cheap enough for every step). Exceptions from ``on_stall`` are
    logged, never raised into the watchdog thread. ``clock`` is injectable for tests.
    """

    def __init__(self, stall_seconds: float, on_stall: Callable[[float], None], *,
                 poll_seconds: float | None = None, clock: Callable[[], float] = time.monotonic,
                 name: str = "nsa-watchdog") -> None:
        if not stall_seconds > 0:
            raise ValueError(f"stall_seconds must be > 0, got {stall_seconds!r}")
        if not callable(on_stall):
            raise ValueError("on_stall must be callable(seconds_since_kick: float)")
        self.stall_seconds = float(stall_seconds)
        self.on_stall = on_stall
        # Poll a few times per stall window, but not busier than 20 Hz nor lazier than 5 s.
        self.poll_seconds = float(poll_seconds) if poll_seconds else min(5.0, max(0.05, stall_seconds / 4))
        self._clock = clock
        self._name = name
        self._last_kick = clock()
        self._fired = False
        self._paused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stall_count = 0

    def start(self) -> "Watchdog":
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stop.clear()
        self.kick()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    def kick(self) -> None:
        """Record progress: ends a stall episode and restarts the countdown."""
        self._last_kick = self._clock()
        self._fired = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Suspend stall detection for a known-long phase (eval, checkpoint upload); kicks on exit."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.kick()

    def seconds_since_kick(self) -> float:
        return self._clock() - self._last_kick

    def check(self) -> bool:
        """One evaluation (the thread calls this every ``poll_seconds``). Returns True if it fired."""
        if self._paused or self._fired:
            return False
        age = self.seconds_since_kick()
        if age < self.stall_seconds:
            return False
        self._fired = True  # once per episode, even if the handler raises
        self.stall_count += 1
        try:
            self.on_stall(age)
        except Exception:  # the watchdog must outlive a failing handler
            log.exception("watchdog on_stall handler failed")
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.check()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._thread = None

    @property
    def stalled(self) -> bool:
        """True between a stall firing and the next kick."""
        return self._fired

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


STALL_EXIT_CODE = 75   # os._exit code of a worker that the watchdog ended (EX_TEMPFAIL: retry may heal it)
STALL_ACTIONS = ("record", "halt", "restart")


def make_stall_handler(run_dir: str | os.PathLike, heartbeat: Heartbeat | None = None,
                       get_step: Callable[[], int] = lambda: -1, *,
                       exit_code: int | None = None, action: str = "record",
                       is_stalled: Callable[[], bool] = lambda: True, grace_seconds: float = 0.0,
                       exit_fn: Callable[[int], None] = os._exit) -> Callable[[float], None]:
    """The trainer's ``on_stall``: stack dump into ``run_dir`` + a ``stall`` heartbeat, then ``action``.

    ``get_step`` reads the loop's current step (a plain attribute read; no locking needed).
    ``action`` (``train.on_stall``):
      record   nothing more: the run waits (it goes on if the hang ends).
      restart  ``exit_fn(STALL_EXIT_CODE)`` (``os._exit``, the only way to stop a stuck main thread): under
               Ray Train the worker group fails and FailureConfig restarts it from the last checkpoint,
               counted against ``runtime.max_failures``.
      halt     writes ``run_dir/.HALT`` (the loop checkpoints and stops on every rank if the step ever
               finishes); if ``is_stalled()`` still holds ``grace_seconds`` later, exits as ``restart``
               does, and the restarted group reads .HALT and stops at its first step boundary.
    ``exit_code`` (the lanes' hard timeout) exits at once with that code, whatever ``action`` says.
    """
    if action not in STALL_ACTIONS:
        raise ValueError(f"train.on_stall={action!r}: use one of {', '.join(STALL_ACTIONS)}")
    run_dir = Path(run_dir)
    if exit_code is None and action == "restart":
        exit_code = STALL_EXIT_CODE

    def _leave(code: int) -> None:
        # No logging.shutdown(): the stuck thread may hold a handler lock. Flush and leave.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        exit_fn(int(code))

    def on_stall(seconds_since_kick: float) -> None:
        dump = None
        try:
            dump = dump_stacks(run_dir / _stackdump_name("stall"), reason=f"stall {seconds_since_kick:.1f}s")
        except OSError:
            log.exception("stall stack dump failed")
        try:
            step = int(get_step())
        except Exception:
            step = -1
        log.warning("no progress for %.1f s at step %d; stacks in %s; on_stall=%s", seconds_since_kick, step,
                    dump, action)
        if heartbeat is not None:
            heartbeat.write(KIND_STALL, step, seconds_since_kick=round(seconds_since_kick, 3),
                            stack_dump=str(dump) if dump else None, exiting=exit_code is not None,
                            action=action)
        if exit_code is not None:
            _leave(exit_code)
            return
        if action == "halt":
            (run_dir / ".HALT").write_text(f"stall at step {step}: no progress for {seconds_since_kick:.0f} s "
                                           f"(train.on_stall=halt)\n")

            def _escalate() -> None:
                if is_stalled():
                    log.warning("still stalled %.0f s after .HALT; ending the worker", grace_seconds)
                    _leave(STALL_EXIT_CODE)
            timer = threading.Timer(max(0.0, grace_seconds), _escalate)
            timer.daemon = True
            timer.start()

    return on_stall
