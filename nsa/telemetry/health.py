"""Gate health as the runbooks define it: per layer, entropy mean > 0.5 nats, max-gate mean < 0.9 and a
collapse fraction of about 0. These are warnings, not failures: a healthy model may favour one branch in
some layers (a 125M model trained at 32k put 0.98 on the window branch in one layer), so the thresholds
are configurable (``logging.health_*``) and a violation never stops a run.

Input is the host dict of :func:`nsa.telemetry.stats.layer_stats` (``gate/L<i>/entropy``,
``gate/L<i>/max_gate``, ``gate/L<i>/collapse_frac``), from the live loop, training.csv or the ``stats``
field of ``progress`` heartbeats.
"""
from __future__ import annotations

import math
from typing import Mapping

# stat -> (threshold key, True if the value must stay at or above the threshold)
GATE_RULES = {"entropy": ("min_entropy", True), "max_gate": ("max_gate", False),
              "collapse_frac": ("max_collapse", False)}
DEFAULT_THRESHOLDS = {"min_entropy": 0.5, "max_gate": 0.9, "max_collapse": 0.05}


def gate_violations(stats: Mapping[str, float], thresholds: Mapping[str, float | None] | None = None
                    ) -> list[str]:
    """One short line per (layer, stat) outside its threshold, e.g. ``gate/L3/max_gate=0.98 > 0.9``.

    A threshold of None disables that rule; NaN values (stats not recorded) are ignored."""
    th = {**DEFAULT_THRESHOLDS, **(thresholds or {})}
    out = []
    for key in sorted(stats):
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != "gate" or parts[2] not in GATE_RULES:
            continue
        name, floor = GATE_RULES[parts[2]]
        limit, value = th.get(name), stats[key]
        if limit is None or value is None or not math.isfinite(value):
            continue
        if (value < limit) if floor else (value > limit):
            out.append(f"{key}={value:.3g} {'<' if floor else '>'} {limit:g}")
    return out


def thresholds_from_logging(lg: object) -> dict[str, float | None]:
    """The ``logging.health_*`` fields of a LoggingConfig as :func:`gate_violations` thresholds."""
    return {"min_entropy": getattr(lg, "health_min_entropy", DEFAULT_THRESHOLDS["min_entropy"]),
            "max_gate": getattr(lg, "health_max_gate", DEFAULT_THRESHOLDS["max_gate"]),
            "max_collapse": getattr(lg, "health_max_collapse", DEFAULT_THRESHOLDS["max_collapse"])}
