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

``private_instance`` adds the other half of "this driver's own instance": its processes carry the driver's
marker and a reaper ends them all when the driver dies, SIGKILL included (nsa/launch/reaper.py).
"""
from __future__ import annotations

import contextlib
import os
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


_REAPERS: list[Any] = []      # kept referenced: the reaper outlives the instance's start, by design


@contextlib.contextmanager
def private_instance() -> Iterator[dict[str, Any]]:
    """``with private_instance() as kw: ray.init(..., **kw)``: a loopback-only instance whose processes carry
    this driver's marker (set in the environment for the ``ray.init`` call only), reaped when the driver,
    the GCS or the raylet ends (nsa/launch/reaper.py)."""
    import ray
    from nsa.config.env import RAY_OWNER_VAR, scoped_process_env
    from nsa.launch.reaper import new_marker
    marker, node = new_marker(), ray._private.worker._global_node
    with scoped_process_env({RAY_OWNER_VAR: marker}), loopback_only() as kw:
        yield kw
    if ray._private.worker._global_node not in (None, node):      # an instance was started just now
        _start_reaper(f"{RAY_OWNER_VAR}={marker}")


def _start_reaper(needle: str) -> None:
    import ray
    from ray._private import ray_constants
    from nsa.launch.reaper import start_ticks, start_reaper
    node = ray._private.worker._global_node
    watched = [f"{info.process.pid}:{start_ticks(info.process.pid)}"
               for kind in (ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET)
               for info in node.all_processes.get(kind, [])]
    _REAPERS[:] = [r for r in _REAPERS if r.poll() is None]      # collect the ended ones (no zombies)
    reaper = start_reaper(needle, node.get_session_dir_path(), watched,
                          os.path.join(node.get_logs_dir_path(), "nsa_reaper.log"))
    if reaper is not None:
        _REAPERS.append(reaper)
