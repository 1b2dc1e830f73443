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

Under ``ray job submit`` the driver joins a running cluster, so the env settings above never reach Ray's
processes, and the PlacementGroupCleaner actor's state-API call resolves its cluster by auto-detection
(RAY_ADDRESS unset in actors): with another instance alive it fails as above, or, worse, it finds another
cluster through /tmp/ray/ray_current_cluster. ``cluster_runtime_env`` hands the job's own GCS address to
every process of the job, which removes the cause; ``filter_worker_logs`` drops the watcher's line from the
worker output the driver prints (the watcher stays on there: a cluster can be preempted).
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

# (all texts in one line) of worker log lines the driver need not print: Ray's warning about the
# PreemptionWatcher it starts itself, whose constructor arguments sit in the object store
ROUTINE_LOG_LINES = (("PreemptionWatcher", "has constructor arguments in the object store"),)

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


def _is_gcs_address(address: str) -> bool:
    """host:port, as ``ray job submit`` gives its driver; not "auto", "local" or a ray:// client URL."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and "/" not in address)


def cluster_runtime_env(address: str, verbose: bool) -> dict[str, Any]:
    """The ``runtime_env`` for ``ray.init(address=...)`` on a running cluster: RAY_ADDRESS for every process
    of this job (Ray Train's helper actors then query this cluster, whatever else runs on the machine), and,
    unless verbose, the thread filter in each of them. Keys the job's own runtime env sets already
    (``ray job submit --runtime-env-json``) are left to it: Ray refuses to merge a key given twice."""
    from nsa.config import ray_job_runtime_env
    try:
        from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR as job_var
    except ImportError:
        job_var = "RAY_JOB_CONFIG_JSON_ENV_VAR"
    job_env = ray_job_runtime_env(job_var)
    env: dict[str, Any] = {}
    if _is_gcs_address(address) and "RAY_ADDRESS" not in (job_env.get("env_vars") or {}):
        env["env_vars"] = {"RAY_ADDRESS": address}
    if not verbose and "worker_process_setup_hook" not in job_env:
        env["worker_process_setup_hook"] = "nsa.telemetry.quiet.install_thread_filter"
    return env


def is_routine_line(line: str) -> bool:
    return any(all(t in line for t in texts) for texts in ROUTINE_LOG_LINES)


def filter_worker_logs() -> bool:
    """Drop ROUTINE_LOG_LINES from the worker output this driver prints (call after ``ray.init``; idempotent).
    Wraps Ray's own printing handler; False, and nothing changed, where Ray's internals differ."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        handlers = list(dispatcher.handlers)
        for i, (name, handler) in enumerate(handlers):
            if name != "ray_print_logs" or getattr(handler, "_nsa_filtered", False):
                continue

            def filtered(data: dict[str, Any], _print: Any = handler) -> None:
                lines = data.get("lines") or []
                kept = [ln for ln in lines if not is_routine_line(ln)]
                if len(kept) != len(lines):
                    log.debug("dropped %d routine Ray log line(s)", len(lines) - len(kept))
                    if not kept:
                        return
                    data = {**data, "lines": kept}
                _print(data)
            filtered._nsa_filtered = True      # type: ignore[attr-defined]
            handlers[i] = (name, filtered)
        dispatcher.handlers = handlers
    return any(getattr(h, "_nsa_filtered", False) for _, h in handlers)
