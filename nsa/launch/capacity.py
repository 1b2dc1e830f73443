"""Cold start: make the GPUs a job needs exist before its worker group is placed.

A cluster whose GPU node type autoscales from 0 has no GPU when the driver starts. Ray Train would leave an
unplaceable worker group pending (and retry it forever), and the driver's fail-fast resource check
(builder.check_resources) refuses it, so the driver itself asks the autoscaler for the worker bundles
(``ray.autoscaler.sdk.request_resources``), prints a progress line while nodes start, and proceeds once
the cluster has the GPUs, or fails after ``runtime.gpu_wait_seconds`` with one line saying what the
cluster reported and the fix.

The request is dropped (an empty request) as soon as the GPUs are up, and on timeout or interrupt:
an autoscaler request is cluster-wide state that outlives the driver, so keeping it for the run's life
would pin the GPU nodes after a driver that dies without cleaning up (a SIGKILLed job). Dropping it early
costs nothing: idle nodes are kept for the cluster's idle timeout (minutes) while the worker group is
placed, and from then on the group's own placement group is the demand the autoscaler sees (also when
Ray Train restarts the group after a lost node). request_resources is "last call wins" for the whole
cluster, so two drivers waiting at once overwrite each other's request; each still waits for its own count.

    ensure_gpus(cfg, n, per_worker)   # builder.check_resources calls it (a no-op for CPU jobs)
    wait_for_gpus(need, bundles, cluster=<snapshot/request object>, ...)   # the logic, testable without Ray
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from nsa.launch.cli import UserError

POLL_SECONDS = 5.0          # between looks at the cluster: node starts take minutes, a poll is cheap
REPEAT_SECONDS = 60.0       # an unchanged progress line is printed again this often (a sign of life in job logs)
NO_AUTOSCALER_SECONDS = 60.0  # no autoscaler status for this long: nothing will add nodes (a plain `ray start`
                              # cluster); an autoscaler publishes its status every few seconds


@dataclass(frozen=True)
class Snapshot:
    """What the cluster reports at one moment."""
    gpus: float                    # GPUs of the alive nodes (ray.cluster_resources)
    free_gpus: float               # of those, not held by anyone (ray.available_resources)
    nodes: int                     # alive nodes
    starting: Optional[int] = None  # nodes the autoscaler is launching or setting up; None: no autoscaler report
    note: str = ""                 # the autoscaler's latest failure (e.g. a launch error), if any


class Cluster(Protocol):
    def snapshot(self) -> Snapshot: ...
    def request(self, bundles: list[dict[str, float]]) -> None: ...


class RayCluster:
    """The connected Ray cluster (ray.init done). ``autoscaled``: False for a Ray instance this process
    started itself (no autoscaler can add nodes to it)."""

    def __init__(self, autoscaled: bool = True) -> None:
        self.autoscaled = autoscaled

    def snapshot(self) -> Snapshot:
        import ray
        starting, note = autoscaler_report()
        return Snapshot(gpus=ray.cluster_resources().get("GPU", 0.0),
                        free_gpus=ray.available_resources().get("GPU", 0.0),
                        nodes=sum(1 for n in ray.nodes() if n.get("Alive")), starting=starting, note=note)

    def request(self, bundles: list[dict[str, float]]) -> None:
        from ray.autoscaler.sdk import request_resources
        request_resources(bundles=bundles)


def autoscaler_report() -> tuple[Optional[int], str]:
    """(nodes starting, latest launch failures) from what the autoscaler publishes for `ray status`;
    (None, "") when no autoscaler publishes anything. Autoscaler v1 (Ray's default, the launcher and
    KubeRay without v2 switched on) writes a JSON status to the GCS key __autoscaling_status; v2 keeps its
    state in the GCS, read through ray.autoscaler.v2.sdk (that branch was not exercised here)."""
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get
        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        if raw:
            rep = json.loads(raw).get("autoscaler_report") or {}
            starting = sum((rep.get("pending_launches") or {}).values()) + len(rep.get("pending_nodes") or [])
            return starting, _failures([str(f[1]) for f in rep.get("failed_nodes") or []])
        from ray.autoscaler.v2.utils import is_autoscaler_v2
        if not is_autoscaler_v2():
            return None, ""
        import ray
        from ray.autoscaler.v2.sdk import get_cluster_status
        st = get_cluster_status(ray.get_runtime_context().gcs_address)
        starting = sum(r.count for r in st.pending_launches) + len(st.pending_nodes)
        return starting, _failures([r.ray_node_type_name for r in st.failed_launches for _ in range(r.count)]
                                   + [n.ray_node_type_name for n in st.failed_nodes])
    except Exception:             # private APIs: a missing or changed report only loses detail
        return None, ""


def _failures(types: list[str]) -> str:
    return f"{len(types)} node launch(es) failed ({', '.join(sorted(set(types)))})" if types else ""


def _n(x: float) -> str:
    return f"{x:g}"


def progress_line(need: float, snap: Snapshot, elapsed: float, timeout_s: float) -> str:
    """e.g. 'waiting for 2 GPUs: 0 ready, 1 node starting (12s of 900s, runtime.gpu_wait_seconds)'."""
    if snap.starting is None:
        starting = "no autoscaler report yet"
    else:
        starting = f"{snap.starting} node{'' if snap.starting == 1 else 's'} starting"
    extra = f", {snap.note}" if snap.note else ""
    return (f"waiting for {_n(need)} GPUs: {_n(snap.gpus)} ready, {starting}{extra} "
            f"({elapsed:.0f}s of {timeout_s:.0f}s, runtime.gpu_wait_seconds)")


def timeout_error(need: float, snap: Snapshot, waited: float, *, autoscaled: bool = True) -> str:
    """The one-line error when the GPUs did not come up."""
    seen = f"the cluster has {_n(snap.gpus)} GPUs on {snap.nodes} alive node{'' if snap.nodes == 1 else 's'}"
    if not autoscaled:
        return (f"the job needs {_n(need)} GPUs and {seen} (a Ray instance started by this driver: no autoscaler "
                "can add any): set runtime.gpus (or runtime.num_workers) to what this machine has")
    if snap.starting is None:
        seen += (", and no autoscaler status was seen (a cluster started without an autoscaling config never adds "
                 "nodes)")
    else:
        seen += f", {snap.starting} starting" + (f", {snap.note}" if snap.note else "")
    return (f"waited {waited:.0f}s for {_n(need)} GPUs: {seen}: check `ray status` on the head (GPU quota/capacity, "
            "the GPU node type's max_workers), raise runtime.gpu_wait_seconds, or lower runtime.gpus")


def wait_for_gpus(need: float, bundles: list[dict[str, float]], *, timeout_s: float, cluster: Cluster,
                  autoscaled: bool = True, poll_s: float = POLL_SECONDS, repeat_s: float = REPEAT_SECONDS,
                  no_autoscaler_s: float = NO_AUTOSCALER_SECONDS,
                  echo: Callable[[str], Any] = print, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], Any] = time.sleep) -> Snapshot:
    """Return once ``cluster`` has ``need`` GPUs; before that ask it for ``bundles`` and print progress.
    Raises UserError (timeout_error) after ``timeout_s``, at once where nothing can add GPUs, and after
    ``no_autoscaler_s`` without any autoscaler status."""
    snap = cluster.snapshot()
    if snap.gpus + 1e-9 >= need:
        return snap
    if not autoscaled or timeout_s <= 0:
        raise UserError(timeout_error(need, snap, 0.0, autoscaled=autoscaled))
    t0 = clock()
    cluster.request(bundles)
    try:
        echo(f"asking the autoscaler for {len(bundles)} x {bundles[0]} (runtime.num_workers x per-worker resources)")
        last, last_t = "", -repeat_s
        while True:
            elapsed = clock() - t0
            if snap.gpus + 1e-9 >= need:
                echo(f"{_n(snap.gpus)} GPUs ready after {elapsed:.0f}s")
                return snap
            if elapsed >= timeout_s or (snap.starting is None and elapsed >= no_autoscaler_s):
                raise UserError(timeout_error(need, snap, elapsed))
            line = progress_line(need, snap, elapsed, timeout_s)
            key = line.split(" (", 1)[0]           # the state without the clock: print on change or every repeat_s
            if key != last or elapsed - last_t >= repeat_s:
                echo(line)
                last, last_t = key, elapsed
            sleep(min(poll_s, max(0.0, timeout_s - elapsed)))
            snap = cluster.snapshot()
    finally:
        cluster.request([])


def ensure_gpus(cfg: Any, n: int, per_worker: dict[str, float], *, cluster: Optional[Cluster] = None,
                **wait: Any) -> None:
    """The builder's hook: a GPU job of ``n`` workers of ``per_worker`` resources (builder.worker_resources)
    waits for ``n x gpus_per_worker`` GPUs. The request is one bundle per worker, as the worker group will
    ask: the autoscaler then picks node types that fit whole workers (GPUs with their CPUs), not loose GPUs.
    ``wait``: more keyword arguments for wait_for_gpus (tests pass a fake clock)."""
    if not cfg.runtime.use_gpu or n <= 0:
        return
    autoscaled = bool(cfg.runtime.ray_address)      # a local instance of our own has no autoscaler
    wait_for_gpus(n * cfg.runtime.gpus_per_worker, [dict(per_worker) for _ in range(n)],
                  timeout_s=cfg.runtime.gpu_wait_seconds, cluster=cluster or RayCluster(autoscaled),
                  autoscaled=autoscaled,
                  **{"echo": lambda s: print(s, flush=True), **wait})


__all__ = ["Snapshot", "RayCluster", "autoscaler_report", "progress_line", "timeout_error", "wait_for_gpus",
           "ensure_gpus"]
