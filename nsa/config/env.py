"""The process environment: every variable nsa reads, and the ones it sets for other libraries (Ray, cuBLAS,
gloo), in one place. Config fields come from ``NSA_*`` variables through ``resolve_config``; these are the others."""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any, Iterator, Mapping


def extra_output_dir(env: Mapping[str, str] | None = None) -> str | None:
    """``$OUT``: a folder that device-run harnesses collect (bench scripts copy their JSON there)."""
    env = os.environ if env is None else env
    return env.get("OUT") or None


def env_storage_root(env: Mapping[str, str] | None = None) -> str | None:
    """``$NSA_STORAGE_ROOT`` (empty = unset): the default of ``prepare_data.py --storage-root``, which has no
    RunConfig of its own."""
    env = os.environ if env is None else env
    return env.get("NSA_STORAGE_ROOT") or None


def triton_interpreter(env: Mapping[str, str] | None = None) -> bool:
    """Triton's own ``TRITON_INTERPRET=1``: kernels run on CPU tensors through its interpreter (the tests
    set it before triton is imported). The one place nsa reads it."""
    env = os.environ if env is None else env
    return env.get("TRITON_INTERPRET") == "1"


EAGER_GRAPHS_VALUES = ("auto", "off")


def eager_graphs(env: Mapping[str, str] | None = None) -> str:
    """``$NSA_EAGER_GRAPHS`` (auto | off; empty = auto): auto serves an eager NSA op call on CUDA whose call signature
    was seen before from CUDA graphs of its forward and backward (nsa/ops/eager_graph.py). Read once, at import."""
    value = ((os.environ if env is None else env).get("NSA_EAGER_GRAPHS") or "auto").strip().lower()
    if value not in EAGER_GRAPHS_VALUES:
        raise ValueError(f"NSA_EAGER_GRAPHS={value!r}: must be one of {EAGER_GRAPHS_VALUES} (unset = auto)")
    return value


# Process environment that other libraries read (Ray, cuBLAS), each set only where the user has not set it.
# Ray's driver-side switches: no print patching of workers' stdout, no token auth on a local instance.
RAY_DRIVER_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_AUTH_MODE": "disabled"}
# A local instance has no preemption to watch; the watcher's actor start logs an error line (telemetry/quiet.py).
RAY_LOCAL_QUIET_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# A command-line tool's log has no room for MLflow's artifact upload progress bars.
CLI_MLFLOW_ENV = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
# torch.use_deterministic_algorithms(True) needs a fixed cuBLAS workspace, read at cuBLAS's first use.
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


# Set by a driver during its ray.init only: every process of its private instance inherits the driver's marker,
# by which the reaper finds them and the train workers watch the driver (nsa/launch/reaper.py).
RAY_OWNER_VAR = "_NSA_RAY_OWNER"


def ray_owner(env: Mapping[str, str] | None = None) -> str | None:
    """The marker ``<pid>:<start ticks>:<nonce>`` of the driver whose private Ray instance runs this process."""
    return (os.environ if env is None else env).get(RAY_OWNER_VAR) or None


def apply_process_env(values: Mapping[str, str], override: bool = False) -> None:
    """Set these variables in this process where unset (a user's own setting wins), or always with override."""
    for name, value in values.items():
        if override:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


@contextlib.contextmanager
def scoped_process_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set these variables for the block only; afterwards each is as it was (or unset again)."""
    saved = {name: os.environ.get(name) for name in values}
    apply_process_env(values, override=True)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def mlflow_system_metrics_on(env: Mapping[str, str] | None = None) -> bool:
    """MLflow's own ``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``: false / 0 / no / off keeps a run's system metrics off."""
    value = (os.environ if env is None else env).get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "")
    return value.strip().lower() not in ("0", "false", "no", "off")


def ray_job_runtime_env(var: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``runtime_env`` of the Ray job this driver runs under (Ray passes the job's config as JSON in ``var``);
    {} outside a job or when unreadable."""
    try:
        return json.loads((os.environ if env is None else env).get(var) or "{}").get("runtime_env") or {}
    except (ValueError, AttributeError):
        return {}
