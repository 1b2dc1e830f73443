"""Resource sizing: what one running lane holds, and how many lanes the cluster fits at once."""
from __future__ import annotations

import os
from typing import Any, Optional

from nsa.config import RunConfig
from nsa.launch import builder, capacity
from nsa.launch.lanes.plan import GridPlan
from nsa.launch.lanes.schema import LaneError

TRIAL_CPU = 0.01          # the trial's driver only waits on fit(); Tune refuses a request of 0 resources
DATA_TASK_CPUS = 1.0      # what one Ray Data read/map task asks for (Ray's default; builder sets none)


def lane_demand(cfg: RunConfig) -> dict[str, float]:
    """Logical resources one running lane holds: its worker group plus its trial's driver."""
    n, per = builder.resolve_num_workers(cfg), builder.worker_resources(cfg)
    return {"CPU": n * per["CPU"] + TRIAL_CPU, "GPU": n * per.get("GPU", 0.0)}


def ensure_lane_gpus(cfgs: list[RunConfig], concurrent: Optional[int] = None, **wait: Any) -> None:
    """Before any Tune trial starts on a GPU base: the GPUs of ``concurrent`` (default 1) of the largest
    lane, asked of the autoscaler and waited for (nsa/launch/capacity.py). The trials' own check then finds
    them up, and size_concurrency sizes the grid from what is up."""
    gpu = [c for c in cfgs if c.runtime.use_gpu]
    if gpu:
        cfg = max(gpu, key=lambda c: builder.resolve_num_workers(c) * c.runtime.gpus_per_worker)
        n = builder.resolve_num_workers(cfg) * max(1, concurrent or 1)
        capacity.ensure_gpus(cfg, n, builder.worker_resources(cfg), **wait)


def size_concurrency(plan: GridPlan, requested: Optional[int]) -> int:
    """Check every lane fits the cluster and how many fit at once, leaving Ray Data its CPU share (the
    2-core deadlock). An unplaceable worker group is retried forever by Ray, so refuse that before fit().
    The default also stays within the local cores when this process started the Ray instance."""
    import ray
    total = ray.cluster_resources()
    for lc in plan.lanes:
        try:
            builder.check_resources(lc.cfg, builder.resolve_num_workers(lc.cfg))
        except ValueError as e:
            raise LaneError(f"lane {lc.lane.name!r}: {e}") from None
    need = {k: max(lane_demand(lc.cfg)[k] for lc in plan.lanes) for k in ("CPU", "GPU")}
    # the lanes' Ray Data tasks share what the worker groups leave; each task needs DATA_TASK_CPUS at once,
    # so less than that left free deadlocks every lane at its first batch (seen with 2 lanes on 2 CPUs)
    keep = max(builder.MIN_FREE_DATA_CPUS, DATA_TASK_CPUS)
    free = {"CPU": total.get("CPU", 0.0) - keep, "GPU": total.get("GPU", 0.0)}
    fit = max(0, min(int((free[k] + 1e-9) // v) for k, v in need.items() if v > 0))
    room = (f"each lane holds up to {need['CPU']:g} CPU" + (f" and {need['GPU']:g} GPU" if need["GPU"] else "")
            + f"; the cluster has {total.get('CPU', 0):g} CPU, {keep:g} of them kept for Ray Data tasks")
    if fit < 1:
        raise LaneError(f"no lane fits: {room}; lower runtime.cpus_per_worker or raise runtime.ray_num_cpus")
    if requested is not None:
        if not 1 <= requested <= fit:
            raise LaneError(f"--max-concurrent={requested}: {room}, so 1 to {fit} lanes fit at once "
                            "(lower runtime.cpus_per_worker to fit more)")
        return requested
    local_cap = (os.cpu_count() or 1) if not plan.base_cfg.runtime.ray_address else fit
    return max(1, min(fit, len(plan.lanes), local_cap))
