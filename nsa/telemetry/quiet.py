"""Keep Ray's routine noise off the user's terminal unless ``logging.verbose=true``.

Measured on Ray 2.60 with a local instance (tiny run, another Ray instance alive on the machine):
- Train v2's PlacementGroupCleanerMonitor thread (in the driver) asks the state API for an actor; with two
  local instances that raises ``ConnectionError: Found multiple active Ray instances`` and Python prints
  the whole traceback on stderr. The run is unaffected: the thread only cleans up placement groups.
- The core worker logs an ``E`` line when the PreemptionWatcher actor starts (constructor arguments in the
  object store with max_restarts > 0). A local instance has no preemption to watch, so the watcher is
  off there (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0``); on a cluster it stays on.
Filtered exceptions go to the ``nsa.ray_noise`` logger at DEBUG; any other thread exception reaches
stderr through the previous hook, unchanged.
"""
from __future__ import annotations

import logging
import threading
from typing import Any

from nsa.config import RAY_LOCAL_QUIET_ENV, apply_process_env

log = logging.getLogger("nsa.ray_noise")

# (thread name prefix, exception type name, text in the message) of background-thread failures that are
# routine: the run goes on and nothing is lost
ROUTINE_THREAD_ERRORS = (("PlacementGroupCleaner", "ConnectionError", "multiple active Ray instances"),)

_previous_hook: Any = None


def is_routine(thread_name: str, exc: BaseException | None) -> bool:
    if exc is None:
        return False
    return any(thread_name.startswith(t) and type(exc).__name__ == e and m in str(exc)
               for t, e, m in ROUTINE_THREAD_ERRORS)


def _hook(args: threading.ExceptHookArgs) -> None:
    name = args.thread.name if args.thread is not None else ""
    if is_routine(name, args.exc_value):
        log.debug("routine Ray background error in thread %s: %s", name, args.exc_value)
        return
    (_previous_hook or threading.__excepthook__)(args)


def install_thread_filter() -> None:
    """Route routine background-thread errors (ROUTINE_THREAD_ERRORS) to DEBUG in this process
    (idempotent). Also Ray's ``worker_process_setup_hook`` of a quiet local instance: Train v2's
    controller, where the PlacementGroupCleanerMonitor thread runs, is an actor process, not the driver."""
    global _previous_hook
    if threading.excepthook is not _hook:
        _previous_hook = threading.excepthook
        threading.excepthook = _hook


def quiet_ray(verbose: bool, *, local: bool) -> None:
    """Install the filters (idempotent). Call before ``ray.init`` so the env settings reach Ray's processes."""
    if verbose:
        return
    if local:
        apply_process_env(RAY_LOCAL_QUIET_ENV)
    install_thread_filter()
