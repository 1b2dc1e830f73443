"""Loopback-only binding for the Ray instance a driver starts for itself (``train.py`` without a cluster).

Measured on Ray 2.60 (Linux): a plain ``ray.init()`` listens on every interface (GCS, raylet, workers
and the dashboard agent on ``::``/``0.0.0.0``, the runtime-env agent on the host's IP), so anyone who
can reach the machine can submit work to it. ``ray.init(_node_ip_address="127.0.0.1")`` alone does not
help: Ray turns a loopback address into the host's IP (``services.resolve_ip_for_localhost``) unless
``ray_constants.ENABLE_RAY_CLUSTER`` is false (its default on macOS/Windows, where Ray keeps to
loopback). With it false during ``ray.init``, every listener above binds to 127.0.0.1 only.

The trade-off: such an instance serves this machine only (no other node can join it), which is what a
locally started instance is for. A cluster (``ray start --head``, KubeRay) binds where its nodes can
reach it; protect it at the network level as cluster/README.md describes.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def loopback_only() -> Iterator[dict[str, Any]]:
    """``with loopback_only() as kw: ray.init(..., **kw)`` starts an instance bound to 127.0.0.1."""
    from ray._private import ray_constants
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield {"_node_ip_address": LOOPBACK}
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
