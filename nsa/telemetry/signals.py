"""Operator control of a running loop: signals where they can be installed, control files everywhere.

Signals (seeds 000/004): ``kill -USR1 <pid>`` -> stack dump of every thread into ``dump_dir``;
``kill -USR2 <pid>`` -> checkpoint at the next step boundary; ``kill -TERM <pid>`` -> checkpoint and
exit at the next step boundary (a second SIGTERM falls back to the default action: dies at once).

Python only lets the main thread install handlers, and Ray Train workers run the loop in a thread,
so :func:`install_signal_handlers` returns False there and the loop relies on :class:`ControlFiles`
instead: ``touch run_dir/.CHECKPOINT`` (consumed when seen) and ``echo "reason" > run_dir/.HALT``
(kept, so restarted workers halt too; remove it before relaunching).

Under DDP every rank sees signals/files at slightly different steps; the loop must agree on them
(e.g. rank 0 decides and broadcasts) before acting, or ranks leave collectives at different steps.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from .watchdog import dump_stacks

log = logging.getLogger(__name__)

_SIGNAL_NAMES = ("SIGUSR1", "SIGUSR2", "SIGTERM")
# Installed state, so a second install or restore_signal_handlers() puts the old handlers back.
_previous: dict[int, Any] = {}
_native_file: Any = None


class ControlFlags:
    """Requests for the loop, set by signal handlers, control files or anyone else.

    Setters only assign attributes (safe inside a signal handler); the loop reads them at step
    boundaries: ``if flags.take_checkpoint_request(): save()``; ``if flags.stop_requested: ...``.
    """

    def __init__(self) -> None:
        self.checkpoint_requested = False
        self.stop_requested = False
        self.stop_reason = ""

    def request_checkpoint(self) -> None:
        self.checkpoint_requested = True

    def request_stop(self, reason: str = "SIGTERM") -> None:
        self.stop_requested = True
        if not self.stop_reason:
            self.stop_reason = reason

    def take_checkpoint_request(self) -> bool:
        """True once per request (read and clear)."""
        requested = self.checkpoint_requested
        self.checkpoint_requested = False
        return requested

    def __repr__(self) -> str:
        return (f"ControlFlags(checkpoint_requested={self.checkpoint_requested}, "
                f"stop_requested={self.stop_requested}, stop_reason={self.stop_reason!r})")


def install_signal_handlers(dump_dir: str | os.PathLike, on_checkpoint_request: Callable[[], None],
                            on_terminate: Callable[[], None], *, native_dump: bool = True) -> bool:
    """Install SIGUSR1 (stack dump), SIGUSR2 (checkpoint request) and SIGTERM (terminate request).

    The callbacks run inside the handler, so they must only set flags (e.g. the methods of
    :class:`ControlFlags`). ``native_dump`` also registers faulthandler on SIGUSR1, whose C-level
    dump (appended to ``dump_dir/stackdump_native_pid<pid>.txt``) appears even when the main thread
    is stuck in C code and Python handlers cannot run. Returns False, with a logged reason, where
    handlers cannot be installed (not the main thread; platform without these signals).
    """
    if not callable(on_checkpoint_request) or not callable(on_terminate):
        raise ValueError("on_checkpoint_request and on_terminate must be callables taking no arguments")
    if threading.current_thread() is not threading.main_thread():
        log.warning("signal handlers not installed: thread %r is not the main thread (Ray workers run "
                    "the loop in a thread); use ControlFiles(run_dir) (.HALT/.CHECKPOINT) instead",
                    threading.current_thread().name)
        return False
    missing = [n for n in _SIGNAL_NAMES if not hasattr(signal, n)]
    if missing:
        log.warning("signal handlers not installed: this platform has no %s; use ControlFiles", missing)
        return False
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    restore_signal_handlers()  # idempotent re-install
    term_count = [0]

    def _on_usr1(signum: int, frame: Any) -> None:
        # The one non-trivial handler: it runs in the main thread between bytecodes, and opening a
        # file there is fine (it is not a C-level async handler).
        try:
            path = dump_stacks(dump_dir, reason="SIGUSR1")
            log.warning("SIGUSR1: stacks of all threads written to %s", path)
        except OSError:
            log.exception("SIGUSR1 stack dump failed")

    def _on_usr2(signum: int, frame: Any) -> None:
        on_checkpoint_request()

    def _on_term(signum: int, frame: Any) -> None:
        term_count[0] += 1
        if term_count[0] > 1:  # operator insists: default action (terminate now)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        on_terminate()

    handlers = {signal.SIGUSR1: _on_usr1, signal.SIGUSR2: _on_usr2, signal.SIGTERM: _on_term}
    try:
        for signum, handler in handlers.items():
            _previous[signum] = signal.signal(signum, handler)
    except (ValueError, OSError) as exc:
        restore_signal_handlers()
        log.warning("signal handlers not installed: %s; use ControlFiles", exc)
        return False
    if native_dump:
        _register_native_dump(dump_dir)
    return True


def close_dump_file(fh: Any) -> None:
    """Close a file faulthandler was given, and delete it if no dump was written into it: faulthandler needs
    the file open before any signal, but a run dir should hold a stackdump file only where a dump happened."""
    try:
        empty = os.fstat(fh.fileno()).st_size == 0
    except (OSError, ValueError):      # already closed
        empty = False
    name = getattr(fh, "name", None)
    fh.close()
    if empty and isinstance(name, str):
        Path(name).unlink(missing_ok=True)


def _register_native_dump(dump_dir: Path) -> None:
    global _native_file
    try:
        _native_file = open(dump_dir / f"stackdump_native_pid{os.getpid()}.txt", "a", encoding="utf-8")
        # chain=True: after the C-level dump, the Python handler above still runs (richer dump).
        faulthandler.register(signal.SIGUSR1, file=_native_file, all_threads=True, chain=True)
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("faulthandler SIGUSR1 dump not registered: %s", exc)
        if _native_file is not None:
            _native_file.close()
            _native_file = None


def restore_signal_handlers() -> None:
    """Put back the handlers that were in place before :func:`install_signal_handlers`."""
    global _native_file
    if _native_file is not None:
        faulthandler.unregister(signal.SIGUSR1)
        close_dump_file(_native_file)
        _native_file = None
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_previous.items()):
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        del _previous[signum]


class ControlFiles:
    """Polling control through files in the run directory; works in any thread and any process.

    - ``.HALT``: stop (checkpoint, then exit). Its text is the reason. Left in place.
    - ``.CHECKPOINT``: checkpoint at the next step boundary. Deleted when seen (one file, one save).

    ``poll()`` touches the filesystem at most every ``min_interval_s`` seconds (cheap to call every
    step even on a network filesystem).
    """

    HALT = ".HALT"
    CHECKPOINT = ".CHECKPOINT"

    def __init__(self, run_dir: str | os.PathLike, *, min_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s!r}")
        self.run_dir = Path(run_dir)
        self.halt_path = self.run_dir / self.HALT
        self.checkpoint_path = self.run_dir / self.CHECKPOINT
        self.min_interval_s = float(min_interval_s)
        self._clock = clock
        self._last_poll: float | None = None

    def poll(self, flags: ControlFlags | None = None, *, force: bool = False) -> ControlFlags:
        """Update ``flags`` (a new :class:`ControlFlags` if None) from the files and return them."""
        flags = flags if flags is not None else ControlFlags()
        now = self._clock()
        if not force and self._last_poll is not None and now - self._last_poll < self.min_interval_s:
            return flags
        self._last_poll = now
        if self.halt_path.exists():
            flags.request_stop(f"{self.HALT}: {self._read_reason()}")
        if self.checkpoint_path.exists():
            try:
                self.checkpoint_path.unlink()
            except FileNotFoundError:  # another rank/process consumed it first; still a request
                pass
            flags.request_checkpoint()
        return flags

    def _read_reason(self) -> str:
        try:
            text = self.halt_path.read_text(encoding="utf-8", errors="replace")[:200].strip()
        except OSError:
            text = ""
        return text or "halt requested"

    def clear(self) -> None:
        """Remove both control files (a fresh launch after an intentional halt)."""
        for path in (self.halt_path, self.checkpoint_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
