"""torch.distributed set-up that stays on loopback when the Ray instance does (nsa/train/ray_local.py).

Ray Train 2.60's TorchConfig has rank 0 host torch's rendezvous store at MASTER_ADDR (Ray's node IP, 127.0.0.1
on a loopback-only instance), but torch's TCPStore server binds every interface whatever the address
(measured: ``TCPStore("127.0.0.1", 0, 1, True)`` listens on ``::``). When the node IP is loopback,
``LoopbackTorchConfig`` instead has rank 0 bind a socket to 127.0.0.1 and hand it to the store
(``master_listen_fd``), and points gloo at the loopback interface (``GLOO_SOCKET_IFNAME``), so nothing a
local run starts is reachable from another machine. On a cluster (a routable node IP) it is Ray's own set-up.
"""
from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass
from typing import Any, Optional

LOOPBACK = "127.0.0.1"
_LISTENER: dict[str, Any] = {}     # rank 0's bound socket, kept until the store owns it


def loopback_ifname() -> Optional[str]:
    """The interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS), None if psutil cannot tell."""
    try:
        import psutil
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
                return name
    except Exception:
        pass
    return None


def bind_loopback() -> int:
    """Rank 0: a listening socket on 127.0.0.1 (any free port) for the store; returns the port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind((LOOPBACK, 0))
    s.listen(128)
    _LISTENER["sock"] = s
    return s.getsockname()[1]


def init_loopback_group(backend: str, world_rank: int, world_size: int, port: int, timeout_s: float = 1800) -> None:
    """init_process_group over a TCPStore on 127.0.0.1:port (rank 0 serves it on its bound socket)."""
    import torch.distributed as dist
    from nsa.config import apply_process_env
    ifname = loopback_ifname()
    # gloo's pair listeners on loopback too (gloo reads only the environment); MASTER_* for whatever reads them
    apply_process_env({"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port),
                       **({"GLOO_SOCKET_IFNAME": ifname} if ifname else {})}, override=True)
    timeout = datetime.timedelta(seconds=timeout_s)
    fd = None
    if world_rank == 0:
        fd = _LISTENER.pop("sock").detach()            # the store closes it
    store = dist.TCPStore(LOOPBACK, port, world_size, world_rank == 0, timeout=timeout, multi_tenant=True,
                          master_listen_fd=fd)
    dist.init_process_group(backend=backend, store=store, rank=world_rank, world_size=world_size, timeout=timeout)


def _backend_cls() -> type:
    from ray.train.torch.config import _TorchBackend
    return _TorchBackend


class _LoopbackBackend(_backend_cls()):   # type: ignore[misc]
    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        import ray
        from ray.train._internal.utils import get_address_and_port
        from ray.train.torch.config import _set_torch_distributed_env_vars
        addr, _ = worker_group.execute_single(0, get_address_and_port)
        if not addr.startswith("127."):
            return super().on_start(worker_group, backend_config)
        backend = backend_config.backend or ("nccl" if worker_group.get_resources_per_worker().get("GPU", 0)
                                             else "gloo")
        port = worker_group.execute_single(0, bind_loopback)
        worker_group.execute(_set_torch_distributed_env_vars)
        ray.get([worker_group.execute_single_async(i, init_loopback_group, backend=backend, world_rank=i,
                                                   world_size=len(worker_group), port=port,
                                                   timeout_s=backend_config.timeout_s)
                 for i in range(len(worker_group))])


def _config_cls() -> type:
    from ray.train.torch import TorchConfig
    return TorchConfig


@dataclass
class LoopbackTorchConfig(_config_cls()):   # type: ignore[misc]
    """TorchConfig whose process group stays on 127.0.0.1 when Ray's node IP is loopback (module doc)."""

    @property
    def backend_cls(self) -> type:
        return _LoopbackBackend
