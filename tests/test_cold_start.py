"""Cold start (nsa/launch/capacity.py): num_workers=-1 is runtime.gpus, and a GPU job on a cluster short of
GPUs asks the autoscaler for them, reports progress, proceeds or times out with what the cluster reported.

The fast tests drive the waiting logic with a scripted cluster and a fake clock. The slow acceptance test
starts a real autoscaling head on this machine: Ray's fake multi-node provider (the one behind
``ray.cluster_utils.AutoscalingCluster``) with a GPU node type that scales from 0, and runs
``pipelines/prod_50k.py`` against it as a job driver. AutoscalingCluster itself is not used: its config
template (``fake_multi_node/example.yaml``) is missing from the ray 2.60 wheel (FileNotFoundError), and its
start/shutdown run ``ray stop --force``, which would stop every other Ray instance on the machine. The
head here has its own ports and temp dir and is stopped by its own process ids."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_overrides
from nsa.config import resolve_config
from nsa.launch import builder
from nsa.launch.capacity import Snapshot, ensure_gpus, progress_line, timeout_error, wait_for_gpus
from nsa.launch.cli import UserError
from nsa.launch.lanes.resources import ensure_lane_gpus

PROD = str(REPO / "pipelines" / "configs" / "prod_50k.yaml")


class ScriptedCluster:
    """Snapshots in order (the last repeats); records the autoscaler requests."""

    def __init__(self, *snaps: Snapshot) -> None:
        self.snaps, self.requests = list(snaps), []

    def snapshot(self) -> Snapshot:
        return self.snaps.pop(0) if len(self.snaps) > 1 else self.snaps[0]

    def request(self, bundles):
        self.requests.append(list(bundles))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def _wait(cluster, need=2, timeout_s=900.0, **kw):
    clock, lines = FakeClock(), []
    bundles = [{"CPU": 4.0, "GPU": 1.0}] * int(need)
    snap = wait_for_gpus(need, bundles, timeout_s=timeout_s, cluster=cluster, echo=lines.append, clock=clock,
                         sleep=clock.sleep, **kw)
    return snap, lines, clock


# ------------------------------------------------------------------------------------------ messages
def test_progress_line():
    s = Snapshot(gpus=0, free_gpus=0, nodes=1, starting=1)
    assert progress_line(2, s, 12.3, 900) == \
        "waiting for 2 GPUs: 0 ready, 1 node starting (12s of 900s, runtime.gpu_wait_seconds)"
    s = Snapshot(gpus=8, free_gpus=8, nodes=2, starting=3, note="1 node launch(es) failed (gpu)")
    assert progress_line(16, s, 60, 900) == ("waiting for 16 GPUs: 8 ready, 3 nodes starting, 1 node launch(es) "
                                             "failed (gpu) (60s of 900s, runtime.gpu_wait_seconds)")
    assert "no autoscaler report yet" in progress_line(2, Snapshot(0, 0, 1), 0, 900)


def test_timeout_error_text():
    msg = timeout_error(16, Snapshot(gpus=8, free_gpus=0, nodes=2, starting=0, note="2 node launch(es) failed (a100)"),
                        901.2)
    assert msg == ("waited 901s for 16 GPUs: the cluster has 8 GPUs on 2 alive nodes, 0 starting, 2 node launch(es) "
                   "failed (a100): check `ray status` on the head (GPU quota/capacity, the GPU node type's "
                   "max_workers), raise runtime.gpu_wait_seconds, or lower runtime.gpus")
    assert "\n" not in msg
    assert "no autoscaler status was seen" in timeout_error(2, Snapshot(0, 0, 1), 5)
    local = timeout_error(2, Snapshot(1, 1, 1), 0, autoscaled=False)
    assert "no autoscaler" in local and "set runtime.gpus" in local and "has 1 GPUs on 1 alive node" in local


def test_autoscaler_report_reads_the_status_for_ray_status(monkeypatch):
    """The v1 autoscaler's status (the JSON `ray status` prints from) -> (nodes starting, failures)."""
    pytest.importorskip("ray")
    import ray.experimental.internal_kv as kv
    from nsa.launch.capacity import autoscaler_report
    status = {"autoscaler_report": {"active_nodes": {"ray.head.default": 1}, "pending_launches": {"a100": 1},
                                    "pending_nodes": [["10.0.0.7", "a100", "setting-up"]],
                                    "failed_nodes": [["10.0.0.9", "a100"], ["10.0.0.8", "a100"]]}}
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key: json.dumps(status).encode())
    assert autoscaler_report() == (2, "2 node launch(es) failed (a100)")
    monkeypatch.setattr(kv, "_internal_kv_get", lambda key: (_ for _ in ()).throw(RuntimeError("not connected")))
    assert autoscaler_report() == (None, "")


# ------------------------------------------------------------------------------------------ waiting
def test_waits_requests_and_releases_when_up():
    cold = Snapshot(gpus=0, free_gpus=0, nodes=1, starting=0)
    starting = Snapshot(gpus=0, free_gpus=0, nodes=1, starting=2)
    half = Snapshot(gpus=1, free_gpus=1, nodes=2, starting=1)
    up = Snapshot(gpus=2, free_gpus=2, nodes=3, starting=0)
    c = ScriptedCluster(cold, starting, starting, half, up)
    snap, lines, clock = _wait(c, poll_s=5.0)
    assert snap == up
    # one request of the worker bundles, then the empty request that drops it
    assert c.requests == [[{"CPU": 4.0, "GPU": 1.0}] * 2, []]
    assert lines[0].startswith("asking the autoscaler for 2 x {'CPU': 4.0, 'GPU': 1.0}")
    # a line per change of state, not per poll (the two polls of "2 nodes starting" print once)
    assert [ln.split(" (")[0] for ln in lines[1:-1]] == [
        "waiting for 2 GPUs: 0 ready, 0 nodes starting", "waiting for 2 GPUs: 0 ready, 2 nodes starting",
        "waiting for 2 GPUs: 1 ready, 1 node starting"]
    assert lines[-1] == "2 GPUs ready after 20s" and clock.t == 1020.0


def test_no_wait_and_no_request_when_the_gpus_are_there():
    c = ScriptedCluster(Snapshot(gpus=4, free_gpus=0, nodes=2, starting=0))
    snap, lines, _ = _wait(c)
    assert snap.gpus == 4 and c.requests == [] and lines == []


def test_timeout_raises_with_the_last_report_and_drops_the_request():
    c = ScriptedCluster(Snapshot(gpus=0, free_gpus=0, nodes=1, starting=1))
    with pytest.raises(UserError) as e:
        _wait(c, timeout_s=30, poll_s=5.0, repeat_s=10.0)
    assert str(e.value).startswith("waited 30s for 2 GPUs: the cluster has 0 GPUs on 1 alive node, 1 starting:")
    assert c.requests[-1] == [] and len(c.requests) == 2


def test_repeats_an_unchanged_line_as_a_sign_of_life():
    c, clock, lines = ScriptedCluster(Snapshot(gpus=0, free_gpus=0, nodes=1, starting=1)), FakeClock(), []
    with pytest.raises(UserError):
        wait_for_gpus(1, [{"GPU": 1.0}], timeout_s=30, cluster=c, poll_s=5.0, repeat_s=10.0, echo=lines.append,
                      clock=clock, sleep=clock.sleep)
    assert [ln.split("starting ")[1] for ln in lines[1:]] == [
        "(0s of 30s, runtime.gpu_wait_seconds)", "(10s of 30s, runtime.gpu_wait_seconds)",
        "(20s of 30s, runtime.gpu_wait_seconds)"]


def test_a_cluster_without_autoscaler_status_fails_after_a_minute():
    c = ScriptedCluster(Snapshot(gpus=0, free_gpus=0, nodes=3, starting=None))
    with pytest.raises(UserError, match=r"^waited 60s for 2 GPUs: .* no autoscaler status was seen"):
        _wait(c, poll_s=5.0)
    assert c.requests[-1] == []


def test_without_an_autoscaler_or_wait_it_fails_at_once():
    for kw in ({"autoscaled": False}, {"timeout_s": 0}):
        c = ScriptedCluster(Snapshot(gpus=1, free_gpus=1, nodes=1, starting=None))
        with pytest.raises(UserError):
            _wait(c, **kw)
        assert c.requests == []


# ------------------------------------------------------------------------------------------ config
def _prod(*overrides: str):
    return resolve_config(PROD, list(overrides))[0]


def test_num_workers_minus_one_is_the_profiles_gpus():
    cfg = _prod()
    assert cfg.runtime.num_workers == -1 and cfg.runtime.gpus == 16 and cfg.runtime.gpu_wait_seconds == 900
    assert builder.resolve_num_workers(cfg) == 16                    # no Ray needed: not the GPUs alive now
    assert builder.resolve_num_workers(_prod("runtime.gpus=4", "runtime.gpus_per_worker=2")) == 2
    assert builder.resolve_num_workers(_prod("runtime.num_workers=3")) == 3   # an explicit count wins
    with pytest.raises(UserError, match="raise runtime.gpus"):
        builder.resolve_num_workers(_prod("runtime.gpus=1", "runtime.gpus_per_worker=2"))
    tiny = resolve_config(str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml"), [])[0]
    assert tiny.runtime.gpus is None and builder.resolve_num_workers(tiny) == 2


def test_unset_gpus_falls_back_to_the_gpus_alive(monkeypatch):
    ray = pytest.importorskip("ray")
    cfg = _prod("runtime.gpus=null")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 3.0})
    assert builder.resolve_num_workers(cfg) == 3
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    with pytest.raises(UserError, match=r"runtime.gpus unset .* no GPU: set runtime.gpus=N"):
        builder.resolve_num_workers(cfg)


def test_ensure_gpus_asks_for_the_worker_bundles():
    cfg = _prod("runtime.ray_address=127.0.0.1:6379", "runtime.gpus=2", "runtime.cpus_per_worker=4")
    c = ScriptedCluster(Snapshot(0, 0, 1, 0), Snapshot(2, 2, 3, 0))
    clock = FakeClock()
    ensure_gpus(cfg, 2, builder.worker_resources(cfg), cluster=c, clock=clock, sleep=clock.sleep)
    assert c.requests == [[{"CPU": 4.0, "GPU": 1.0}] * 2, []]
    cpu = resolve_config(str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml"), [])[0]
    c2 = ScriptedCluster(Snapshot(0, 0, 1, None))
    ensure_gpus(cpu, 2, builder.worker_resources(cpu), cluster=c2)   # CPU profiles never wait
    assert c2.requests == []
    with pytest.raises(UserError, match="no autoscaler can add any"):
        local = _prod("runtime.gpus=2")                              # no ray_address: Ray started locally
        ensure_gpus(local, 2, builder.worker_resources(local), cluster=ScriptedCluster(Snapshot(0, 0, 1, None)))


def test_lanes_wait_for_the_largest_lane_times_the_concurrency():
    big = _prod("runtime.ray_address=127.0.0.1:6379", "runtime.gpus=2")
    small = _prod("runtime.ray_address=127.0.0.1:6379", "runtime.gpus=1")
    tiny = resolve_config(str(REPO / "pipelines" / "configs" / "tiny_cpu.yaml"), [])[0]
    c = ScriptedCluster(Snapshot(0, 0, 1, 0), Snapshot(4, 4, 3, 0))
    clock = FakeClock()
    ensure_lane_gpus([small, tiny, big], 2, cluster=c, clock=clock, sleep=clock.sleep)
    assert c.requests == [[{"CPU": 4.0, "GPU": 1.0}] * 4, []]
    c = ScriptedCluster(Snapshot(0, 0, 1, None))
    ensure_lane_gpus([tiny], None, cluster=c)                       # CPU lanes: nothing to wait for
    assert c.requests == []


# ------------------------------------------------------------------------------------------ acceptance
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _autoscaling_config(gcs: str) -> dict:
    """A head with 2 CPUs and no GPU, and a node type of 1 CPU + 1 (logical) GPU that scales 0..2."""
    empty: list = []
    return {"cluster_name": "cold", "max_workers": 2, "idle_timeout_minutes": 5, "upscaling_speed": 1.0,
            "provider": {"type": "external", "gcs_address": gcs, "use_node_id_as_ip": True,
                         "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider",
                         "disable_node_updaters": True, "disable_launch_config_check": True},
            "head_node_type": "ray.head.default",
            "available_node_types": {
                "ray.head.default": {"resources": {"CPU": 2}, "node_config": {}, "max_workers": 0},
                "gpu": {"resources": {"CPU": 1, "GPU": 1}, "node_config": {}, "min_workers": 0, "max_workers": 2}},
            "auth": {"ssh_user": "ray"}, "docker": {}, "file_mounts": {}, "cluster_synced_files": empty,
            "initialization_commands": empty, "setup_commands": empty, "head_setup_commands": empty,
            "worker_setup_commands": empty, "head_start_ray_commands": empty, "worker_start_ray_commands": empty}


def _stop(proc: subprocess.Popen) -> None:
    """Stop the head and everything it (and its autoscaler's fake nodes) started, by process id."""
    import psutil
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
    for k in kids:
        try:
            k.kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture()
def autoscaling_head():
    pytest.importorskip("psutil")
    ray_bin = Path(sys.executable).with_name("ray")
    ray_bin = str(ray_bin) if ray_bin.exists() else (shutil.which("ray") or "ray")
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")           # short: unix socket paths are length-limited
    # the fake nodes are started by the head's autoscaler process and inherit its environment: this
    # checkout's nsa for their workers, and the switch the fake provider requires
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "PYTHONPATH": str(REPO), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    for attempt in range(3):       # a port picked free can be taken before Ray binds it: retry on fresh ports
        port = _free_port()
        cfg_path = Path(tmp) / "autoscaling.json"
        cfg_path.write_text(json.dumps(_autoscaling_config(f"127.0.0.1:{port}")))
        extra = [f"--{name}={_free_port()}" for name in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
            "ray-client-server-port", "metrics-export-port", "node-manager-port", "object-manager-port")]
        log = open(Path(tmp) / "head.log", "w")
        proc = subprocess.Popen([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={tmp}",
                                 "--block", "--include-dashboard=false", "--disable-usage-stats",
                                 "--node-ip-address=127.0.0.1", f"--autoscaling-config={cfg_path}", *extra],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        head_log = Path(tmp) / "head.log"
        while time.time() < deadline and proc.poll() is None and "Ray runtime started" not in head_log.read_text():
            time.sleep(1)
        if proc.poll() is None and time.time() < deadline:
            break
        _stop(proc)
        log.close()
        if attempt == 2:
            pytest.fail(f"ray head not up: {(Path(tmp) / 'head.log').read_text()[-2000:]}")
    try:
        yield f"127.0.0.1:{port}", env, Path(tmp)
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


# The fake GPUs are logical, so this driver changes two things for the job: CPU torch has no NCCL (gloo
# instead), and Ray hands each worker "cuda:0" for its GPU id (each worker trains on the CPU instead).
_DRIVER = """
import runpy, sys
import ray.train.torch as rtt
orig = rtt.TorchTrainer

class CpuTrainer(orig):   # a class: the project subclasses TorchTrainer (nsa/train/ray_trainer.py)
    def __init__(self, loop, *a, torch_config=None, **k):
        def on_cpu(config):
            import torch
            import ray.train.torch as t
            t.get_device = lambda: torch.device("cpu")
            return loop(config)
        torch_config = torch_config or rtt.TorchConfig()
        torch_config.backend = "gloo"
        super().__init__(on_cpu, *a, torch_config=torch_config, **k)

rtt.TorchTrainer = CpuTrainer
sys.argv = ["pipelines/prod_50k.py", *sys.argv[1:]]
runpy.run_path("pipelines/prod_50k.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.ray
def test_prod_50k_waits_for_the_autoscaler_then_trains(autoscaling_head, tiny_data, tmp_path):
    address, env, tmp = autoscaling_head
    # prod_50k's runtime (num_workers=-1, use_gpu, gpus_per_worker 1) with runtime.gpus=2 on a cluster that
    # has none; the model and data shrunk to the tiny profile's
    args = tiny_overrides(tiny_data, tmp_path, logging__name="cold", train__steps=3, train__save_every=0,
                          train__eval_every=0, train__warmup_steps=1, train__seq_len=64, train__batch_size=4,
                          model__dim=64, model__n_layers=1, model__n_heads=4, model__d_k=16, model__d_v=16,
                          model__grad_checkpointing=False, nsa__l=16, nsa__d=8, nsa__l_sel=16, nsa__n_sel=4,
                          nsa__w=64, runtime__gpus=2, runtime__cpus_per_worker=0.5, runtime__precision="fp32",
                          runtime__cuda_graph=False, runtime__gpu_wait_seconds=240, data__prefetch_batches=2)
    r = subprocess.run([sys.executable, "-c", _DRIVER, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=600, env={**env, "RAY_ADDRESS": address})
    out = r.stdout + r.stderr
    (tmp_path / "driver.log").write_text(out)
    logs = tmp / "session_latest" / "logs" / "monitor.log"
    assert r.returncode == 0, out[-4000:] + (logs.read_text()[-2000:] if logs.is_file() else "")
    assert "ray: connected to" in out
    assert "asking the autoscaler for 2 x {'CPU': 0.5, 'GPU': 1.0}" in out
    assert "waiting for 2 GPUs: 0 ready" in out                       # it waited ...
    assert "2 GPUs ready after" in out                               # ... the autoscaler added the nodes ...
    assert out.index("2 GPUs ready after") < out.index("step 1/3")    # ... before the workers started
    summary = json.loads((tmp_path / "cold" / "metrics.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2   # ... and both workers trained
