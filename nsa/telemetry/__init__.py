"""Telemetry: heartbeat JSONL, watchdog + stack dumps, operator control, on-device stats, loggers, checks.

This package imports neither mlflow nor tensorboard (sinks import them when built), and its own
modules other than ``stats`` do not need torch: the stats names load on first use (PEP 562). (The
parent ``nsa/__init__`` currently imports the model, hence torch, anyway.)
"""
from __future__ import annotations

from typing import Any

from .heartbeat import KINDS, Heartbeat, heartbeat_path, iter_heartbeat, read_heartbeat
from .loggers import (CSVLogger, MetricLogger, MLflowLogger, MultiLogger, TensorBoardLogger, build_loggers,
                      flatten_params, plot_training)
from .signals import ControlFiles, ControlFlags, install_signal_handlers, restore_signal_handlers
from .watchdog import STALL_EXIT_CODE, Watchdog, dump_stacks, make_stall_handler

_CHECK_NAMES = ("CheckResult", "run_checks")
_STATS_NAMES = ("gate_stats", "selection_stats", "layer_stats", "to_host", "RollingPercentiles",
                "memory_mib", "mean_over_layers")

__all__ = [
    "Heartbeat", "KINDS", "heartbeat_path", "iter_heartbeat", "read_heartbeat",
    "STALL_EXIT_CODE", "Watchdog", "dump_stacks", "make_stall_handler",
    "ControlFiles", "ControlFlags", "install_signal_handlers", "restore_signal_handlers",
    "MetricLogger", "CSVLogger", "TensorBoardLogger", "MLflowLogger", "MultiLogger", "build_loggers",
    "flatten_params", "plot_training",
    *_CHECK_NAMES, *_STATS_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _STATS_NAMES:
        from . import stats
        return getattr(stats, name)
    if name in _CHECK_NAMES:  # lazy so `python -m nsa.telemetry.check` runs the module only once
        from . import check
        return getattr(check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
