"""`ray job submit --working-dir . -- python pipelines/prod_50k.py` against a local head started and stopped
by cluster/scripts/local_head.sh, the README's local sequence.

The head is this test's own (own temp dir, every port picked free) and is stopped by that script's `stop`,
which ends exactly this head's processes, never with `ray stop` (which would also stop the session's other
Ray instance). The head's environment names the storage root (NSA_STORAGE_ROOT), as the cluster nodes do."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, tiny_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]
HEAD_SCRIPT = REPO / "cluster" / "scripts" / "local_head.sh"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_bin() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _head_processes(tmp: str) -> list[str]:
    """Command lines of live processes that name this head's Ray temp dir."""
    out = subprocess.run(["ps", "-ww", "-eo", "args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if f"{tmp}/ray/" in line]


@pytest.fixture()
def head_cluster(tmp_path):
    """(job API url, client env, head dir, storage root) of a head from `local_head.sh start`."""
    tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")          # short: unix socket paths are length-limited
    storage = tmp_path / "shared"
    storage.mkdir()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
           "NSA_HEAD_DIR": tmp}
    env.pop("RAY_ADDRESS", None)
    env.pop("NSA_STORAGE_ROOT", None)
    # the job's driver must get this checkout's nsa (nsa.launch) from --working-dir alone: Ray puts the
    # uploaded copy first on the driver's and workers' PYTHONPATH, so none is inherited from the test run
    env.pop("PYTHONPATH", None)
    # ports from the ephemeral range: a dashboard port in Ray's worker range (10002-19999) is refused
    r = subprocess.run(["bash", str(HEAD_SCRIPT), "start", "--storage", str(storage), "--dashboard-port",
                        str(_free_port()), "--", "--num-cpus=4"], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        log = Path(tmp) / "head.log"
        pytest.fail(f"local_head.sh start failed: {r.stdout}{r.stderr}"
                    f"{log.read_text()[-2000:] if log.is_file() else ''}")
    url = (Path(tmp) / "address").read_text().strip()
    assert f"export RAY_ADDRESS={url}" in r.stdout
    try:
        yield url, env, Path(tmp), storage
    finally:
        r = subprocess.run(["bash", str(HEAD_SCRIPT), "stop"], env=env, capture_output=True, text=True,
                           timeout=180)
        left = _head_processes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        assert r.returncode == 0 and "stopped the local head" in r.stdout, r.stdout + r.stderr
        assert not left, f"local_head.sh stop left processes of this head: {left}"


def _head_logs(tmp: Path) -> str:
    """Tails of the head's logs, for a failure message."""
    parts = []
    for f in [tmp / "head.log", *sorted((tmp / "session_latest" / "logs").glob("dashboard*.log"))]:
        if f.is_file():
            parts.append(f"\n--- {f.name}\n" + f.read_text(errors="replace")[-800:])
    return "".join(parts)


def _files(root: Path) -> set[str]:
    """Files under root, relative, without the bytecode Python writes when it imports the copy."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def _uploaded() -> set[str] | None:
    """What `--working-dir .` uploads by default: the files git does not ignore (None without git)."""
    r = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                       text=True)
    if r.returncode != 0:
        return None
    return {f for f in r.stdout.split("\0") if f and (REPO / f).is_file()}


def test_ray_job_submit_prod_50k_keeps_results_on_storage(ray_session, head_cluster, tiny_data):
    """The headline command with relative paths: results under the head's storage root, none in the copy.
    ray_session keeps a second Ray instance alive on the machine, where Ray's routine noise used to show."""
    url, env, tmp, storage = head_cluster
    shutil.copytree(tiny_data, storage / "data" / "tiny")
    # prod_50k's profile shrunk to the tiny CPU model; logging.root and data.path stay relative
    args = tiny_overrides(Path("data/tiny"), Path("runs"), train__steps=6, logging__name="job",
                          train__save_every=0, train__eval_every=3, logging__mlflow=True,
                          model__dim=128, model__n_layers=2, model__n_heads=4, model__n_kv_groups=2,
                          model__d_k=32, model__d_v=32, model__grad_checkpointing=False,
                          nsa__l=16, nsa__d=8, nsa__l_sel=16, nsa__n_sel=4, nsa__w=64,
                          runtime__use_gpu=False, runtime__num_workers=2, runtime__cpus_per_worker=0.5,
                          runtime__precision="fp32", train__lr=3e-3)
    t0 = time.time()
    for _ in range(20):   # the head's job agent comes up a little after the dashboard answers
        r = subprocess.run([_ray_bin(), "job", "submit", "--address", url, "--working-dir", str(REPO), "--",
                            "python", "pipelines/prod_50k.py", *args], cwd=REPO, env=env, capture_output=True,
                           text=True, timeout=600)
        if "No available agent" not in r.stdout + r.stderr:
            break
        time.sleep(2)
    wall = time.time() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:] + _head_logs(tmp)
    assert "ray: connected to" in out                        # RAY_ADDRESS from the job -> no local instance
    assert "== completed at step 6/6" in out and "succeeded" in out
    for noise in ("multiple active Ray instances", "Exception in thread PlacementGroupCleaner",
                  "has constructor arguments in the object store"):      # README: stays off the terminal
        assert noise not in out, out[-3000:]
    run_dir = storage.resolve() / "runs" / "job"
    assert f"run dir:      {run_dir}" in out
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert (storage / "runs" / "mlflow.db").is_file()
    # without the root the same job is refused before it writes: Ray's real copy is recognised
    r = subprocess.run([_ray_bin(), "job", "submit", "--address", url, "--working-dir", str(REPO), "--",
                        "python", "pipelines/prod_50k.py", *args, "runtime.storage_root=null"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "error: logging.root='runs' -> " in out, out[-3000:]
    assert "data.path='data/tiny'" in out and "inside Ray's working-dir copy" in out
    assert "set runtime.storage_root=/mnt/shared" in out
    # Ray's copies of the working dir (kept in its cache after the jobs) hold exactly what was uploaded: one
    # copy, or one per job where a file of the checkout changed between the two submits (e.g. a test log
    # written into it while the suite runs; Ray names a copy by its content's hash)
    copies = list((tmp / "ray" / "session_latest" / "runtime_resources" / "working_dir_files").glob("_ray_pkg_*/"))
    assert 1 <= len(copies) <= 2, copies
    uploaded = _uploaded()
    for copy in copies:
        in_copy = _files(copy)
        assert not [f for f in in_copy if f.split("/")[0] in ("runs", "data", "mlruns", "mlartifacts")
                    or f.endswith((".db", ".parquet", ".jsonl"))], sorted(in_copy)[:50]
        if uploaded is not None:
            assert in_copy == uploaded, (sorted(in_copy - uploaded)[:20], sorted(uploaded - in_copy)[:20])
        else:
            assert all((REPO / f).is_file() for f in in_copy)
    print(f"ray job submit wall time: {wall:.1f}s")
