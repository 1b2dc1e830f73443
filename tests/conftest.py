"""Shared fixtures: ONE local Ray instance per test session (started lazily, only by tests that ask for
it) and a small real-text data set prepared once per session from the offline local corpus."""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path
from types import ModuleType

import pytest

# Without CUDA every Triton kernel test runs through the interpreter. The variable must be set before
# anything imports triton (torch.compile/dynamo does too), so it is set here, before test collection.
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _skip_repeated_interpreter_patches() -> None:
    """Triton's interpreter (triton/runtime/interpreter.py) patches triton.language for a kernel launch
    (``GridExecutor.__call__``: ``_patch_lang``, restored when the grid is done) and then AGAIN on every call
    of a nested @jit function (``InterpretedFunction.__call__``: tl.sum, our helpers), rebuilding identical
    closures over the same interpreter builder and never restoring them: about 1 ms per call, more than half
    of the kernel tests' time. Here a nested call whose language modules (tl / tl.core in its globals) the
    running launch has already patched skips the repeat; the first call for modules not yet patched (the
    standard library's tl.core) still patches them, as before. Kernel semantics are untouched: the patched
    attributes are the same, only not rebuilt. A Triton without these internals is left as it is."""
    import inspect
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
        orig_patch, orig_grid, empty_scope = ti._patch_lang, ti.GridExecutor.__call__, ti._LangPatchScope
    except (ImportError, AttributeError):
        return
    active: list = []          # per launch in progress: ids of the language modules patched so far
    langs: dict = {}

    def langs_of(fn) -> frozenset:
        key = id(fn.__globals__)
        if key not in langs:
            langs[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs[key]

    def patch_lang(fn):
        if active and langs_of(fn) <= active[-1]:
            return empty_scope()
        scope = orig_patch(fn)
        if active:
            active[-1] = active[-1] | langs_of(fn)
        return scope

    def grid_call(self, *args, **kwargs):
        active.append(frozenset())
        try:
            return orig_grid(self, *args, **kwargs)
        finally:
            active.pop()

    ti._patch_lang, ti.GridExecutor.__call__ = patch_lang, grid_call
    ti._patch_lang.skips_repeats = True           # tests/test_triton_kernels.py checks it is installed


def _row_invariant_interpreter_dot() -> None:
    """The interpreter's tl.dot is np.matmul, i.e. the CPU's BLAS, and some of its sgemm kernels (OpenBLAS's
    Haswell one, picked on AVX2 machines) round an output row differently depending on where the row sits
    in the tile. A GPU MMA sums every output element over k in one order wherever its row is, and the
    bitwise tests (grouped vs consecutive query tiles) hold on that. Here a float dot sums each element's
    products along k in one fixed order ([.., M, N, K] products reduced over their last, contiguous axis),
    so a kernel's results do not depend on the CPU the tests run on. Integer dots stay np.matmul (exact)."""
    import numpy as np
    try:
        from triton.runtime import interpreter as ti
        orig = ti.InterpreterBuilder.create_dot
    except (ImportError, AttributeError):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = d.data.dtype
        if not np.issubdtype(out, np.floating):
            return orig(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):   # fp8: as the interpreter does
            a_data = ti._convert_float(a_data, a.dtype, ti.tl.float16, None).view(np.float16)
            b_data = ti._convert_float(b_data, b.dtype, ti.tl.float16, None).view(np.float16)
        a_data, b_data = a_data.astype(out), np.swapaxes(b_data.astype(out), -1, -2)   # [.., M, K], [.., N, K]
        prod = a_data[..., :, None, :] * b_data[..., None, :, :]                        # [.., M, N, K]
        return ti.TensorHandle(prod.sum(-1, dtype=out) + d.data, d.dtype.scalar)

    create_dot.row_invariant = True            # tests/test_interpreter_dot.py checks it is installed
    ti.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_repeated_interpreter_patches()
    _row_invariant_interpreter_dot()

# Every Ray instance a test starts (the session's, a subprocess driver's, a `ray start` head) inherits this
# environment. Ray runs its workers at nice 15 by default: beside the other xdist worker's CPU-bound kernel tests
# (nice 0) on 2 cores, the Ray group's train workers, controllers and data tasks then got a fraction of a core and
# its serial chain of launches took about twice its solo time. Nice 0 shares the cores evenly.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray Train's controller polls its workers every 2 s by default, so each launch's end and each worker restart was
# noticed up to 2 s late (some 30 launches and restarts in the Ray group); a missed poll is only retried.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


REPO = Path(__file__).resolve().parents[1]
PIPELINES = REPO / "pipelines"
TINY_PROFILE = str(PIPELINES / "configs" / "tiny_cpu.yaml")


# fixtures that start Ray (here and in test modules): their users count as Ray tests without the marker too
RAY_FIXTURES = frozenset({"ray_session", "ray_local", "autoscaling_head"})


@pytest.hookimpl(tryfirst=True)   # before xdist's own, which turns the group marks into node ids on each worker
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's `-n 2 --dist loadgroup`), every test that starts Ray (marker `ray`, or
    a fixture of RAY_FIXTURES) runs on one worker, in one Ray session (ray_session is per worker), while the
    other worker takes the kernel and model tests: Ray's start-up and polling waits overlap CPU-bound tests
    instead of adding to them."""
    for item in items:
        if item.get_closest_marker("ray") is not None or RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance with 4 logical CPUs (2 workers x 0.5 CPU + Ray Data tasks fit on 2 cores)."""
    ray = pytest.importorskip("ray")
    from nsa.launch import builder
    started = not ray.is_initialized()
    if started:
        builder.start_local_ray(num_cpus=4)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """~1.5 MB of real text (Python stdlib sources/docs) as train shards + a val shard."""
    from nsa.data.shards import write_shards
    from nsa.data.sources import iter_source
    out = tmp_path_factory.mktemp("pipeline_data") / "tiny"
    write_shards(iter_source("local", None, max_bytes=1_500_000, seed=0), out, val_docs=8, shard_bytes=600_000)
    return out


def load_entry_point(path: Path) -> ModuleType:
    """An entry-point script (e.g. pipelines/smoke.py) as a module, without putting its folder on sys.path;
    its ``if __name__ == "__main__"`` block does not run."""
    spec = importlib.util.spec_from_file_location(f"entry_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_overrides(data: Path, root: Path, **extra: object) -> list[str]:
    """The tiny profile shrunk for tests: seq 64, log every step, no TensorBoard/MLflow unless asked."""
    base = {"data.path": str(data), "logging.root": str(root), "train.seq_len": 64, "train.batch_size": 8,
            "train.warmup_steps": 5, "train.eval_batches": 2, "logging.log_every": 1,
            "logging.stats_every": 10, "logging.tensorboard": False, "logging.mlflow": False}
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(autouse=True, scope="session")
def _quiet_ray_env():
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    yield


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes: one intra-op thread is faster than two spinning ones (restored afterwards).
    Model/layer test modules use it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _restore_fp32_matmul_precision():
    """Training code turns TF32 on process-wide (nsa.train.precision.enable_tf32); a later test that uses
    an fp32 CUDA path as its reference must not inherit it, so every test gets the flags back."""
    import torch
    prec, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(prec)
    torch.backends.cudnn.allow_tf32 = cudnn


@pytest.fixture
def poison_allocations(monkeypatch):
    """torch.empty / empty_like return NaN-filled floats and -7-filled ints, so any element a kernel
    leaves unwritten fails the comparison. Kernel test modules use it through ``pytestmark``."""
    import torch
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(x):  # only what the kernels allocate (triton's launcher may allocate uint8 scratch; autograd's
        if x.requires_grad:   # leaves, e.g. checkpoint's empty marker, cannot be filled in place)
            return x
        if x.is_floating_point():
            return x.fill_(float("nan"))
        return x.fill_(-7) if x.dtype in (torch.int32, torch.int64) else x

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


@pytest.fixture()
def run_train(monkeypatch, capsys):
    """pipelines/train.py run in-process as __main__ -> (exit code, stderr, stdout). Reaching Ray would mean the
    launch was not refused (or validated) before Ray starts: ``connect_ray`` fails the test if called."""
    from nsa.launch import builder

    def no_ray(cfg):
        raise AssertionError("connect_ray reached: the launch should have been refused before Ray starts")

    monkeypatch.setattr(builder, "connect_ray", no_ray)

    def go(*args):
        monkeypatch.setattr(sys, "argv", ["train.py", *args])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(str(PIPELINES / "train.py"), run_name="__main__")
        out = capsys.readouterr()
        return e.value.code, out.err, out.out
    return go


def local_cfg(data: Path, root: Path, **kw: object):
    """A one-layer tiny run of 8 steps without Ray (logging.name "r"); kw: field__name=value overrides."""
    from nsa.config import resolve_config
    kw = {"model__n_layers": 1, "model__dim": 64, "train__steps": 8, "train__save_every": 0,
          "train__eval_every": 0, "logging__name": "r", **kw}
    cfg, _ = resolve_config(TINY_PROFILE, tiny_overrides(data, root, **kw))
    return cfg


def run_local(cfg):
    """run_training on nsa.train.local_env.LocalEnv -> (result, run dir)."""
    import torch
    from nsa.train.local_env import LocalEnv
    from nsa.train.loop import run_training
    torch.set_num_threads(2)
    run_dir = os.path.join(cfg.logging.root, cfg.logging.name)
    return run_training(cfg, run_dir, LocalEnv(cfg, run_dir)), run_dir
