"""The one place that turns a RunConfig into a Ray ``TorchTrainer`` (docs/design.md, principle 7), plus the driver
steps every entry point shares: validate inputs, prepare the run directory, connect to Ray, launch.

    cfg, sources = resolve_config(...)
    validate_inputs(cfg)                      # config/data/checkpoint errors before any worker starts
    run_dir = prepare_run(cfg, sources)       # logging.root/<name>/ + config.yaml; sets logging.name
    connect_ray(cfg)                          # RAY_ADDRESS (ray job submit) -> connect; else local instance
    trainer = build_trainer(cfg, run_dir, make_datasets(cfg))
    trainer.fit()
or all of it: ``launch(cfg, sources, title)``.

Storage: ``RunConfig(storage_path=<logging.root>, name=<logging.name>)`` makes Ray's run directory the
same directory as ours, so Ray's checkpoints land in ``<run dir>/checkpoint_<step:08d>/`` beside the
heartbeats and CSVs, and relaunching with the same ``logging.name`` resumes (Ray resumes by name).
On several nodes ``logging.root`` must be shared storage. Relative paths resolve against
``runtime.storage_root`` when set, else the working directory; results are never written into Ray's
working-dir copy of a ``ray job submit`` (refused, naming the field: nsa/launch/storage.py).

Environment for Ray (documented choices): ``RAY_TRAIN_ENABLE_PRINT_PATCH=0`` (plain worker prints, as
docs/ray.md) always; ``RAY_AUTH_MODE=disabled`` only when this process starts a local instance
(token auth on a private single-machine instance only gets in the way of ``ray job submit``); both are
``setdefault`` so an explicit value wins. A local instance gets the ``nsa`` package via
``runtime_env={"py_modules": [nsa]}``; on a cluster use ``ray job submit --working-dir .``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from nsa.config import RAY_DRIVER_ENV, DataConfig, RunConfig, apply_process_env, dump_yaml
from nsa.launch.cli import UserError
from nsa.train.checkpoint import list_checkpoints, load_checkpoint, verify_checkpoint

DEFAULT_DATA_PATH = DataConfig.path
MIN_FREE_DATA_CPUS = 0.5   # Ray Data read/tokenize tasks need CPU beside the train workers (docs/ray.md)


# ------------------------------------------------------------------------------------------ validation
def _abs(p: str) -> str:
    from nsa.data.sources import is_url
    return p if is_url(p) else str(Path(p).expanduser().resolve())   # hf://, file:// stay URLs


def prepare_local_corpus(out: Path) -> None:
    """Build the default shard directory from the offline local corpus (the data helper's API)."""
    from nsa.launch.owner import FolderBusy, own
    try:   # one builder per folder (as prepare_data.py --out): two at once would leave orphan shards
        lock = own(out, "data.path", "another launch or prepare_data.py is building it: wait for it to end")
    except FolderBusy as e:
        raise UserError(str(e)) from None
    try:
        if not out.exists():      # not built by another launch meanwhile
            _build_local_corpus(out)
    finally:
        lock.release()


def _build_local_corpus(out: Path) -> None:
    from nsa.data.shards import write_shards
    from nsa.data.sources import iter_source
    print(f"data: {out} is missing and data.auto_prepare=true: building it from the offline local corpus "
          "(the Python installation's own source and text files, ~30 MB) ...", flush=True)
    t0 = time.time()
    from nsa.data.sources import OFFLINE_MAX_BYTES, OFFLINE_VAL_DOCS, prepare_inputs
    # the same inputs as a plain `prepare_data.py`, recorded so that running it afterwards is a no-op
    manifest = write_shards(iter_source("local", None, max_bytes=OFFLINE_MAX_BYTES, seed=0), out,
                            val_docs=OFFLINE_VAL_DOCS, source="local:python-stdlib", inputs=prepare_inputs("local"))
    t = manifest["totals"]
    print(f"data: wrote {t['train_shards']} train shards ({t['train_tokens']:,} tokens) + val in "
          f"{time.time() - t0:.1f}s", flush=True)


def _check_model_compat(cfg: RunConfig, ckpt_cfg: dict[str, Any], where: str) -> None:
    mine = cfg.to_dict()
    # a field the checkpoint predates (e.g. model.attention) counts as its default there
    default = {s: dataclasses.asdict(type(getattr(cfg, s))()) for s in ("model", "nsa")}
    diffs = [f"{s}.{k}: checkpoint {ckpt_cfg.get(s, {}).get(k, default[s][k])!r}, config {v!r}"
             for s in ("model", "nsa") for k, v in mine[s].items()
             if k not in ("backend", "allow_flash_attn", "flash_branches", "grad_checkpointing", "dense_backend")
             and ckpt_cfg.get(s, {}).get(k, default[s][k]) != v]
    if diffs:
        raise UserError(f"{where} was trained with another model shape: " + "; ".join(diffs) +
                        " (use the checkpoint's values or start a fresh run)")


def validate_inputs(cfg: RunConfig) -> None:
    """Everything checkable before Ray starts. Makes paths absolute in ``cfg``. Raises UserError &co."""
    from nsa.data.tokenizers import get_tokenizer
    from nsa.launch.storage import apply_storage
    default_data = cfg.data.path == DEFAULT_DATA_PATH
    apply_storage(cfg)     # absolute paths: against runtime.storage_root; never inside Ray's working-dir copy
    from nsa.launch.owner import check_place
    check_place(cfg.logging.root, cfg.logging.name, mlflow_uri(cfg))   # a file in the way is named before Ray
    try:
        get_tokenizer(cfg.data.tokenizer, tiktoken_path=cfg.data.tiktoken_path)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise UserError(f"data.tokenizer={cfg.data.tokenizer!r}: {e}") from None
    if cfg.data.source == "parquet":
        path = Path(cfg.data.path).expanduser()
        if not path.exists() and cfg.data.auto_prepare and default_data:
            prepare_local_corpus(path.resolve())
        cfg.data.path = _abs(cfg.data.path)
        from nsa.data.shards import check_data_path, resolve_val_files
        try:
            check_data_path(cfg.data.path)
            if cfg.data.val_path:
                cfg.data.val_path = _abs(cfg.data.val_path)
                resolve_val_files(cfg.data.path, cfg.data.val_path)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise UserError(f"data.path: {e}") from None
    if cfg.train.resume_from:
        cfg.train.resume_from = _abs(cfg.train.resume_from)
        f, step = verify_checkpoint(cfg.train.resume_from)
        _check_model_compat(cfg, load_checkpoint(f, mmap=True)["config"], f"train.resume_from={f}")
        print(f"resume_from: {f} (step {step})", flush=True)
    uri = cfg.logging.mlflow_uri
    if cfg.logging.mlflow and uri and uri.split(":", 1)[0] not in ("sqlite", "file", "http", "https",
                                                                   "postgresql", "mysql", "databricks"):
        raise UserError(f"logging.mlflow_uri={uri!r} is not an MLflow tracking URI (sqlite:////abs/mlflow.db, "
                        "http://host:5000, ...); or set logging.mlflow=false")
    if cfg.runtime.use_gpu is False and cfg.runtime.num_workers == -1:
        raise UserError("runtime.num_workers=-1 means one worker per GPU but runtime.use_gpu=false; "
                        "set runtime.num_workers to a count")
    from nsa.launch.preflight import preflight
    preflight(cfg)     # a read-only storage_root, too little data or memory: refused before Ray, with numbers


# ------------------------------------------------------------------------------------------ run dir
def _unique_name(prefix: str) -> str:
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def prepare_run(cfg: RunConfig, sources: Optional[dict[str, str]] = None, prefix: str = "run",
                commit: bool = True) -> Path:
    """Lock ``logging.root/<name>/`` for this process (nsa/train/rundir.py) and, with ``commit``, write
    config.yaml. A None name becomes a fresh unique one (stored into ``cfg.logging.name``); an existing
    run dir with checkpoints is resumed from its newest complete one (train.resume=auto) or refused
    (train.resume=never). ``commit=False`` changes nothing in an existing run dir: ``launch`` commits
    (``commit_prepared``) only after the worker group is known to fit the cluster."""
    from nsa.train.rundir import claim_run, release_run
    root = Path(_abs(cfg.logging.root))
    cfg.logging.root = str(root)
    if cfg.logging.name is None:
        cfg.logging.name = _unique_name(prefix)
    claim = claim_run(root, cfg.logging.name, resume=cfg.train.resume)
    try:
        for note in claim.notes:
            print(note, flush=True)
        if claim.resume_file is not None:
            f, step = claim.resume_file, claim.resume_step
            _check_model_compat(cfg, load_checkpoint(f, mmap=True)["config"], f"run {cfg.logging.name}")
            print(f"resume: run {cfg.logging.name} has checkpoints; continuing from step {step} ({f.parent.name})"
                  + (" - train.resume_from is ignored for an existing run" if cfg.train.resume_from else ""),
                  flush=True)
    except BaseException:
        release_run(claim.run_dir)
        raise
    if commit:
        commit_prepared(claim.run_dir, cfg, sources)
    return claim.run_dir


def commit_prepared(run_dir: Path, cfg: RunConfig, sources: Optional[dict[str, str]] = None) -> None:
    from nsa.train.rundir import commit_run
    for line in commit_run(run_dir, dump_yaml(cfg, sources), keep=cfg.train.keep_checkpoints):
        print(line, flush=True)


def mlflow_uri(cfg: RunConfig) -> Optional[str]:
    """Absolute tracking URI (Ray workers run in other directories): default sqlite under logging.root."""
    if not cfg.logging.mlflow:
        return None
    if cfg.logging.mlflow_uri:
        return cfg.logging.mlflow_uri
    return f"sqlite:///{Path(_abs(cfg.logging.root)) / 'mlflow.db'}"


# ------------------------------------------------------------------------------------------ ray
def connect_ray(cfg: RunConfig) -> str:
    """Connect to ``runtime.ray_address`` (set from RAY_ADDRESS under ``ray job submit``), else start a
    local instance with ``runtime.ray_num_cpus`` logical CPUs (None: all cores). Idempotent."""
    import ray
    from nsa.telemetry.quiet import quiet_ray
    apply_process_env(RAY_DRIVER_ENV)
    quiet_ray(cfg.logging.verbose, local=not cfg.runtime.ray_address)   # routine Ray noise off the terminal
    if ray.is_initialized():
        return "ray: using the already initialized instance"
    from nsa.telemetry.quiet import cluster_runtime_env, filter_worker_logs
    if cfg.runtime.ray_address:
        # the job's own address for Ray's helper actors too: with another Ray on the machine they would
        # otherwise auto-detect among all of them (nsa/telemetry/quiet.py)
        ray.init(address=cfg.runtime.ray_address, logging_level="WARNING", log_to_driver=True,
                 runtime_env=cluster_runtime_env(cfg.runtime.ray_address, cfg.logging.verbose) or None)
        if not cfg.logging.verbose:
            filter_worker_logs()
        return f"ray: connected to {cfg.runtime.ray_address}"
    start_local_ray(cfg.runtime.ray_num_cpus, quiet=not cfg.logging.verbose)
    if not cfg.logging.verbose:
        filter_worker_logs()
    return f"ray: started a local instance ({ray.cluster_resources().get('CPU', 0):g} CPUs)"


def start_local_ray(num_cpus: Optional[int] = None, *, quiet: bool = True) -> None:
    """quiet: Ray's processes filter routine background-thread errors too (nsa/telemetry/quiet.py)."""
    import ray
    import nsa
    apply_process_env(RAY_DRIVER_ENV)
    # logging_config applies to every Ray worker/actor of this job: ERROR silences the PlacementGroupCleaner
    # actor's warning loop (it polls the state API, which needs the dashboard we do not start) and Ray's
    # per-task INFO chatter. The train workers lower it back to WARNING for their own records
    # (nsa/train/ray_loop.py), and this driver's logging is put back as it was right after init.
    root, ray_log = logging.getLogger(), logging.getLogger("ray")
    saved = (root.level, root.handlers[:], ray_log.level, ray_log.handlers[:], ray_log.propagate)
    from nsa.train.ray_local import private_instance
    # this machine only (nothing listens on other interfaces), and gone within a second when this driver
    # dies, SIGKILL included (nsa/launch/reaper.py)
    with private_instance() as bind:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING",
                 logging_config=ray.LoggingConfig(encoding="TEXT", log_level="ERROR"),
                 runtime_env={"py_modules": [str(Path(nsa.__file__).parent)],
                              **({"worker_process_setup_hook": "nsa.telemetry.quiet.install_thread_filter"}
                                 if quiet else {})}, **bind)
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    ray_log.setLevel(saved[2])
    ray_log.handlers[:] = saved[3]
    ray_log.propagate = saved[4]


def _alive_nodes() -> list[dict[str, float]]:
    import ray
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


def resolve_num_workers(cfg: RunConfig) -> int:
    """runtime.num_workers, with -1 = runtime.gpus / gpus_per_worker (the GPUs the profile asks for, which
    check_resources then waits for); with runtime.gpus unset, -1 = the GPUs alive in the cluster now."""
    from nsa.launch.preflight import configured_workers   # the rule the pre-Ray checks count with too
    n = configured_workers(cfg)
    if n is not None:
        return n
    per = max(cfg.runtime.gpus_per_worker, 1e-9)
    import ray
    gpus = int(ray.cluster_resources().get("GPU", 0) // per)
    if gpus < 1:
        raise UserError("runtime.num_workers=-1 with runtime.gpus unset means one worker per GPU alive now, and the "
                        "Ray cluster has no GPU: set runtime.gpus=N (the autoscaler is then asked for N GPUs)")
    return gpus


def worker_resources(cfg: RunConfig) -> dict[str, float]:
    res = {"CPU": float(cfg.runtime.cpus_per_worker)}
    if cfg.runtime.use_gpu:
        res["GPU"] = float(cfg.runtime.gpus_per_worker)
    return res


def check_resources(cfg: RunConfig, n: int) -> None:
    """Fail fast if the worker group cannot be placed: Ray would retry an unplaceable group forever.
    A GPU job first asks the autoscaler for missing GPUs and waits for them (nsa/launch/capacity.py)."""
    if n == 0:
        return
    import ray
    from nsa.launch.capacity import ensure_gpus
    per = worker_resources(cfg)
    ensure_gpus(cfg, n, per)
    total = ray.cluster_resources()
    nodes = _alive_nodes()
    for key, amount in per.items():
        need, have = n * amount, total.get(key, 0.0)
        if need > have + 1e-9:
            knob = "runtime.cpus_per_worker" if key == "CPU" else "runtime.gpus_per_worker"
            raise UserError(f"runtime.num_workers={n} x {knob}={amount:g} needs {need:g} {key}, the Ray cluster "
                            f"has {have:g}: lower runtime.num_workers or {knob}")
    fits = [min(int(node.get(k, 0.0) // v) if v > 0 else n for k, v in per.items()) for node in nodes]
    strategy = cfg.runtime.placement_strategy
    ok = {"STRICT_PACK": max(fits, default=0) >= n, "STRICT_SPREAD": sum(f >= 1 for f in fits) >= n}.get(
        strategy, sum(fits) >= n)
    if not ok:
        raise UserError(f"{n} workers of {per} cannot be placed with placement_strategy={strategy} on nodes "
                        f"{[{k: node.get(k, 0) for k in per} for node in nodes]}")
    free_cpu = total.get("CPU", 0.0) - n * per["CPU"]
    if cfg.data.source == "parquet" and free_cpu < MIN_FREE_DATA_CPUS:
        raise UserError(f"the train workers would take {n * per['CPU']:g} of {total.get('CPU', 0):g} CPUs, leaving "
                        f"{free_cpu:g} for Ray Data's read/tokenize tasks, which then never produce a batch (the "
                        "2-core deadlock): lower runtime.cpus_per_worker (e.g. 0.5) or raise runtime.ray_num_cpus")


def val_rows(cfg: RunConfig) -> Any:
    """The fixed held-out rows: the first ``eval_batches * batch_size`` packed rows of the val shards
    (int64 [n, seq_len+1], or None without val data). Built once in the driver, so every evaluation of a
    run (and of every run on the same data) sees the same tokens and no worker runs a read pipeline."""
    import numpy as np
    t, d = cfg.train, cfg.data
    n = t.eval_batches * t.batch_size
    if n <= 0:
        return None
    if d.source == "synthetic":
        from nsa.train.synthetic import synthetic_rows
        return synthetic_rows({"id": np.arange(n)}, t.seq_len, 256 if d.tokenizer == "byte" else cfg.model.vocab,
                              2)["input_ids"]
    from nsa.data.ray_data import iter_packed_batches
    from nsa.data.shards import resolve_val_files
    files = resolve_val_files(d.path, d.val_path)
    if not files:
        return None
    rows = []
    for b in iter_packed_batches(files, t.seq_len, d.tokenizer, 1, tiktoken_path=d.tiktoken_path):
        rows.append(b)
        if len(rows) >= n:
            break
    if len(rows) < t.batch_size:
        print(f"note: the val shards hold {len(rows)} rows of {t.seq_len + 1} tokens, fewer than one batch: "
              "no validation", flush=True)
        return None
    return np.concatenate(rows)


def make_datasets(cfg: RunConfig) -> dict[str, Any]:
    """{"train": ds, "val": ds?} of rows {"input_ids": int64[seq_len+1]}: train is a streaming Ray Data
    pipeline split across workers, consumed for synthetic data only (with parquet data each worker streams
    its own row groups, seekable on resume: nsa/train/ray_loop.py, nsa/data/position.py; this lazy
    pipeline is never executed then); val is the small fixed in-memory set of ``val_rows`` (not split:
    every rank evaluates the same rows)."""
    import ray.data
    ctx = ray.data.DataContext.get_current()          # travels with the datasets to the split coordinator
    ctx.enable_progress_bars = False                  # tqdm bars interleave badly with progress lines
    ctx.print_on_execution_start = False
    t = cfg.train
    if cfg.data.source == "synthetic":
        vocab = 256 if cfg.data.tokenizer == "byte" else cfg.model.vocab
        from nsa.train.synthetic import synthetic_rows
        train = ray.data.range(max(4096, 8 * t.batch_size * t.accumulate)).map_batches(
            synthetic_rows, batch_format="numpy", fn_kwargs={"seq_len": t.seq_len, "vocab": vocab, "seed": 1})
    else:
        from nsa.data.ray_data import build_datasets
        train, _ = build_datasets(cfg.data, t.seq_len)     # its lazy val pipeline is replaced by val_rows
    out = {"train": train}
    rows = val_rows(cfg)
    if rows is not None:
        out["val"] = ray.data.from_items([{"input_ids": r} for r in rows])
    return out


def build_trainer(cfg: RunConfig, run_dir: Path, datasets: dict[str, Any], *,
                  callbacks: Optional[list[Any]] = None) -> Any:
    """The TorchTrainer used by every entry point (train, prod_50k, smoke, lanes). Needs Ray connected.
    ``callbacks``: extra Ray Train callbacks for RunConfig (e.g. Tune's ``TuneReportCallback()``)."""
    from ray.data import ExecutionOptions
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, LoggingConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
    from nsa.train.ray_trainer import NsaTorchTrainer    # user errors in a worker are not retried
    from nsa.train.ray_loop import train_loop_per_worker
    from nsa.train.rendezvous import LoopbackTorchConfig  # torch's store on 127.0.0.1 with a local instance
    n = resolve_num_workers(cfg)
    check_resources(cfg, n)
    run_dir = Path(run_dir).resolve()
    opts = ExecutionOptions(preserve_order=True)   # reproducible stream -> exact data resume (nsa/train/loop.py)
    loop_config = {"cfg": cfg.to_dict(), "run_dir": str(run_dir), "mlflow_uri": mlflow_uri(cfg),
                   "resume_from": cfg.train.resume_from, "torch_threads": max(1, int(cfg.runtime.cpus_per_worker))}
    return NsaTorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config, torch_config=LoopbackTorchConfig(),
        scaling_config=ScalingConfig(num_workers=n, use_gpu=cfg.runtime.use_gpu,
                                     resources_per_worker=worker_resources(cfg),
                                     placement_strategy=cfg.runtime.placement_strategy),
        run_config=RayRunConfig(name=run_dir.name, storage_path=str(run_dir.parent),
                                failure_config=FailureConfig(max_failures=cfg.runtime.max_failures),
                                checkpoint_config=CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
                                logging_config=LoggingConfig(log_level="WARNING"), callbacks=callbacks),
        datasets=datasets,
        dataset_config=DataConfig(datasets_to_split=["train"], execution_options=opts))


# ------------------------------------------------------------------------------------------ launch
@dataclass
class Outcome:
    run_dir: Path
    summary: dict[str, Any]
    exit_code: int
    wall_s: float


class _DriverSignals:
    """In the driver: SIGTERM -> run_dir/.HALT (checkpoint + stop), SIGUSR2 -> .CHECKPOINT, SIGUSR1 -> stacks."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.prev, self.terms = run_dir, {}, 0

    def __enter__(self) -> "_DriverSignals":
        handlers = {"SIGTERM": self._term, "SIGUSR2": self._usr2, "SIGUSR1": self._usr1}
        for name, h in handlers.items():
            try:
                self.prev[name] = signal.signal(getattr(signal, name), h)
            except (ValueError, AttributeError):   # not the main thread / platform without it
                pass
        return self

    def _term(self, *_: Any) -> None:
        self.terms += 1
        if self.terms > 1:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        (self.run_dir / ".HALT").write_text(f"SIGTERM to driver pid {os.getpid()}\n")
        print("driver: SIGTERM -> .HALT written; workers checkpoint and stop at the next step "
              "(send SIGTERM again to abort now)", flush=True)

    def _usr2(self, *_: Any) -> None:
        (self.run_dir / ".CHECKPOINT").write_text("SIGUSR2 to driver\n")

    def _usr1(self, *_: Any) -> None:
        from nsa.telemetry import dump_stacks
        print(f"driver: stacks in {dump_stacks(self.run_dir, reason='SIGUSR1 driver')}", flush=True)

    def __exit__(self, *exc: Any) -> None:
        for name, h in self.prev.items():
            signal.signal(getattr(signal, name), h)


def _fmt(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) and math.isfinite(x) else str(x)


def print_summary(run_dir: Path, summary: dict[str, Any], cfg: RunConfig, wall: float) -> None:
    ck = list_checkpoints(run_dir)
    print(f"== {summary.get('status', '?')} at step {summary.get('step')}/{summary.get('total_steps')} "
          f"in {wall:.1f}s" + (f" ({summary['reason']})" if summary.get("reason") else ""))
    print(f"run dir:      {run_dir}")
    print(f"final loss:   {_fmt(summary.get('final_loss'))} (first logged {_fmt(summary.get('first_logged_loss'))})"
          f"   val loss: {_fmt(summary.get('final_val_loss'))}")
    print(f"throughput:   {_fmt(summary.get('toks_per_s'))} tok/s; step p50/p95 "
          f"{_fmt(summary.get('step_ms_p50'))}/{_fmt(summary.get('step_ms_p95'))} ms; fetch p50/p95 "
          f"{_fmt(summary.get('fetch_ms_p50'))}/{_fmt(summary.get('fetch_ms_p95'))} ms")
    if ck:
        print(f"checkpoint:   {ck[-1][1]}")
    if summary.get("status") in ("halted", "terminated"):
        print(f"resume with:  logging.name={run_dir.name} logging.root={run_dir.parent}")
    uri = mlflow_uri(cfg)
    if uri:
        print(f"mlflow:       mlflow ui --backend-store-uri {uri}")
    if cfg.logging.tensorboard:
        print(f"tensorboard:  tensorboard --logdir {run_dir / 'tb'}", flush=True)


def _fit(trainer: Any, run_dir: Path, cfg: RunConfig) -> int:
    """trainer.fit() under the driver's signal handlers; 1 and one readable line if it fails."""
    from nsa.train.failures import failure_cause
    since = time.time()
    with _DriverSignals(run_dir):
        try:
            trainer.fit()
        except Exception as e:  # TrainingFailedError & co: the cause first (nsa/train/failures.py)
            print(f"error: training failed: {failure_cause(e, run_dir, cfg, since)}\n"
                  f"  see {run_dir}/heartbeat_rank*.jsonl and the Ray logs above", flush=True)
            return 1
    return 0


def _stamp(f: Path) -> Optional[tuple[int, int]]:
    try:
        st = f.stat()
        return st.st_ino, st.st_mtime_ns
    except OSError:
        return None


def _settle(run_dir: Path, cfg: RunConfig) -> None:
    """After fit, still holding the run lock: prune what Ray never registered (a worker group killed right
    after a save) and leave Ray's checkpoint list equal to the run dir (nsa/train/rundir.py)."""
    from nsa.train.rundir import settle_checkpoints
    try:
        for line in settle_checkpoints(run_dir, cfg.train.keep_checkpoints):
            print(line, flush=True)
    except OSError as e:          # the run's result stands; the next launch prunes again
        print(f"note: checkpoints not pruned after the run: {e}", flush=True)


def launch(cfg: RunConfig, sources: dict[str, str], *, prefix: str = "run", quiet: bool = False) -> Outcome:
    """Validate, prepare the run dir, connect Ray, fit, summarise. Raises UserError for user errors."""
    from nsa.train.rundir import release_run
    t0 = time.time()
    validate_inputs(cfg)
    run_dir = prepare_run(cfg, sources, prefix=prefix, commit=False)   # locked; nothing changed yet
    try:
        print(f"run dir: {run_dir}", flush=True)
        print(connect_ray(cfg), flush=True)
        trainer = build_trainer(cfg, run_dir, make_datasets(cfg))
        commit_prepared(run_dir, cfg, sources)
        mfile = run_dir / "metrics.json"
        before = _stamp(mfile)
        code, summary = _fit(trainer, run_dir, cfg), {}
        _settle(run_dir, cfg)
    finally:
        release_run(run_dir)
    if mfile.is_file() and _stamp(mfile) != before:     # an earlier launch's summary is not this one's
        summary = json.loads(mfile.read_text())
    if not code and summary.get("status") in ("anomaly", "failed"):
        code = 1
    if not summary:
        summary = {"status": "failed" if code else "unknown", "step": None, "total_steps": cfg.train.steps}
        code = code or 1
    wall = time.time() - t0
    if not quiet:
        print_summary(run_dir, summary, cfg, wall)
    return Outcome(run_dir=run_dir, summary=summary, exit_code=code, wall_s=wall)


def replace_cfg(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """A copy of ``cfg`` with some fields changed, e.g. replace_cfg(cfg, train={"steps": 2})."""
    from nsa.config import config_from_dict
    d = cfg.to_dict()
    for s, kv in sections.items():
        d[s].update(kv)
    return config_from_dict(d)


__all__ = ["validate_inputs", "prepare_run", "connect_ray", "start_local_ray", "make_datasets", "build_trainer",
           "check_resources", "resolve_num_workers", "mlflow_uri", "launch", "Outcome", "replace_cfg"]
