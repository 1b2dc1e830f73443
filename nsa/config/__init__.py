"""One typed configuration tree for every entry point (docs/design.md, principle 3).

    RunConfig
      model    ModelConfig    TinyLM shape
      nsa      NSAConfig      sparse-attention block sizes and kernel policy
      runtime  RuntimeConfig  devices, Ray workers, precision, fault tolerance
      train    TrainConfig    optimisation schedule, checkpoints, stall/non-finite policy
      data     DataConfig     parquet shards, tokenizer, prefetch
      logging  LoggingConfig  run directory, heartbeat, CSV / TensorBoard / MLflow

Sources, lowest to highest precedence: dataclass default < YAML profile < ``NSA_*`` environment
variable (the documented table below, read once, here only) < ``key=value`` override on the command
line. ``resolve_config`` returns the config and, per dotted field, where its value came from.

Every ``__post_init__`` validates its section and raises ``ConfigError`` (a ``ValueError``) that names
the field and says what to change; cross-section rules live in ``RunConfig.__post_init__``.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union, get_args, get_origin, get_type_hints

import yaml

from nsa.config.env import (CLI_MLFLOW_ENV, DETERMINISTIC_ENV, RAY_DRIVER_ENV, RAY_LOCAL_QUIET_ENV,  # noqa: F401
                             apply_process_env, env_storage_root, extra_output_dir,
                             mlflow_system_metrics_on, ray_job_runtime_env, triton_interpreter)


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _one_of(name: str, value: Any, choices: tuple) -> None:
    _require(value in choices, f"{name}={value!r} is not one of {list(choices)}")


RUN_NAME_MAX_BYTES = 128   # under NAME_MAX (255) with room for ".<name>.lock", "<lane>.repeat" and Ray's own files
RUN_NAME_CHARS = "letters, digits and '_.-+=@,'"


def check_run_name(name: str, field: str = "logging.name") -> str:
    """A run name is one plain path component: it becomes ``logging.root/<name>`` and must stay there. ASCII
    only: Ray's metrics die on non-ASCII names (UnicodeEncodeError) after the workers started."""
    bad = (not name or name.strip() != name or name in (".", "..") or "/" in name or "\\" in name
           or "\x00" in name or name.startswith("-"))
    _require(not bad, f"{field}={name!r} must be one plain directory name under logging.root (not '.' or "
             f"'..', no '/' or backslash, no leading '-' or surrounding spaces), e.g. {field}=my-run")
    size = len(name.encode("utf-8", "surrogatepass"))
    _require(size <= RUN_NAME_MAX_BYTES, f"{field} is {size} bytes long: the limit is {RUN_NAME_MAX_BYTES} bytes "
             f"(it names a directory and its lock file); choose a shorter name")
    odd = sorted({c for c in name if not (c.isascii() and (c.isalnum() or c in "_.-+=@,"))})
    _require(not odd, f"{field}={name!r} has characters Ray and the run files do not take ({''.join(odd)!r}): "
             f"use only ASCII {RUN_NAME_CHARS}, e.g. {field}=my-run")
    return name


def _positive(section: str, obj: Any, names: tuple[str, ...]) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(v > 0, f"{section}.{n}={v} must be > 0")


@dataclass
class ModelConfig:
    vocab: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_groups: int = 2
    d_k: int = 32
    d_v: int = 32
    ffn_mult: float = 4.0
    compression: str = "mlp"          # mlp (paper) | mean | linear
    grad_checkpointing: bool = False
    # torch.compile each block's dense parts (norms, projections, RoPE, compression MLP, gates, SwiGLU);
    # the NSA op is traced as the opaque custom op nsa::attention. Cuts kernel launches ~4x on a launch-bound GPU step.
    compile: bool = False
    # nsa: sparse attention blocks | dense: the same TinyLM with causal full attention (the A/B twin)
    attention: str = "nsa"
    dense_backend: str = "auto"       # the dense twin's kernel: auto or one of nsa.ops.flash.BACKENDS (sdpa_flash, ...)

    def __post_init__(self) -> None:
        _one_of("model.attention", self.attention, ("nsa", "dense"))
        from nsa.ops.flash import BACKENDS as dense   # the one list of kernel names (dense_attention's)
        _one_of("model.dense_backend", self.dense_backend, dense)
        _positive("model", self, ("vocab", "dim", "n_layers", "n_heads", "n_kv_groups", "d_k", "d_v", "ffn_mult"))
        _require(self.n_heads % self.n_kv_groups == 0,
                 f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_groups={self.n_kv_groups} "
                 "(every KV head serves the same number of query heads)")
        _one_of("model.compression", self.compression, ("mlp", "mean", "linear"))


@dataclass
class NSAConfig:
    l: int = 32          # compression block
    d: int = 16          # compression stride
    l_sel: int = 64      # selection block
    n_sel: int = 16      # selected blocks per token (forced blocks included)
    w: int = 512         # sliding window
    backend: str = "auto"          # auto | torch | triton | reference
    allow_flash_attn: bool = True  # false: the kernel policy never imports or uses flash-attn (nsa/ops/flash.py)
    # NSA branches on flash-attn: preset (the device's tuning.flash, set by measurement) | off | win | cmp | win+cmp
    flash_branches: str = "preset"

    def __post_init__(self) -> None:
        _positive("nsa", self, ("l", "d", "l_sel", "n_sel", "w"))
        from nsa.ops.common import check_block_geometry   # the one home of the rule (the op checks it too)
        try:
            check_block_geometry(self.l, self.d, self.l_sel, prefix="nsa.")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _one_of("nsa.backend", self.backend, ("auto", "torch", "triton", "reference"))
        _one_of("nsa.flash_branches", self.flash_branches, ("preset", "off", "win", "cmp", "win+cmp"))


@dataclass
class RuntimeConfig:
    num_workers: int = 2                 # Ray Train workers; 0 = loop in the driver; -1 = gpus / gpus_per_worker
    use_gpu: bool = False
    cpus_per_worker: float = 0.5         # fractional on purpose: docs/ray.md "The 2-core deadlock"
    gpus_per_worker: float = 1.0
    # the GPUs the job wants when num_workers=-1 (the world size, so the global batch, follows from the
    # profile, not from what happens to be alive); None: the GPUs alive in the cluster at start
    gpus: Optional[int] = None
    # a GPU job on a cluster with fewer GPUs than it needs asks the autoscaler for them and waits this long
    # before failing with what the cluster reported (nsa/launch/capacity.py); 0: fail at once
    gpu_wait_seconds: float = 900.0
    placement_strategy: str = "PACK"
    precision: str = "fp32"              # fp32 | bf16 | fp16 (autocast; fp32 master weights)
    tf32: bool = True
    seed: int = 1234
    ray_address: Optional[str] = None    # None: connect under `ray job submit`, else start local Ray
    ray_num_cpus: Optional[int] = None   # logical CPUs of a locally started Ray instance
    # shared storage that outlives a job (the cluster's /mnt/shared): relative logging.root, data.path,
    # data.val_path, train.resume_from and sqlite/file MLflow URIs resolve against it (nsa/launch/storage.py)
    storage_root: Optional[str] = None
    max_failures: int = 2                # Ray FailureConfig: worker-group restarts from the last checkpoint
    detect_anomaly: bool = False
    deterministic: bool = False          # torch.use_deterministic_algorithms(True) in every worker (lanes' repeat check)
    scaler_init_scale: float = 2.0 ** 16
    scaler_growth_interval: int = 2000
    scaler_growth_factor: float = 2.0
    scaler_backoff_factor: float = 0.5
    fault: str = ""                      # test-only fault injection, e.g. "stall@3", "kill@4", "nan@2", "halt@5"
    # replay the whole optimizer step as one CUDA graph after a few eager warm-up steps (nsa/train/graphed.py);
    # where it cannot apply (CPU, DDP, fp16) the loop stays eager and says why in its log and metrics.json
    cuda_graph: bool = False
    cuda_graph_warmup: int = 3
    # ddp: every rank holds the whole model | fsdp: parameters, grads and AdamW state sharded per block
    # (FSDP2 fully_shard, nsa/train/fsdp.py) with sharded DCP checkpoints, for models past one GPU's memory
    sharding: str = "ddp"
    # ranks one sequence is split across (1: none); CP groups of consecutive ranks, world = dp * context_parallel
    context_parallel: int = 1

    def __post_init__(self) -> None:
        _require(self.num_workers >= -1, f"runtime.num_workers={self.num_workers} must be >= -1 (-1: one per GPU of "
                 "runtime.gpus)")
        _require(self.storage_root is None or os.path.isabs(os.path.expanduser(self.storage_root)),
                 f"runtime.storage_root={self.storage_root!r} must be an absolute path (the shared mount, "
                 "e.g. runtime.storage_root=/mnt/shared)")
        _require(self.cpus_per_worker >= 0, f"runtime.cpus_per_worker={self.cpus_per_worker} must be >= 0")
        _require(self.gpus is None or self.gpus >= 1, f"runtime.gpus={self.gpus} must be >= 1 (or null: the GPUs "
                 "alive at start)")
        _require(self.gpu_wait_seconds >= 0, f"runtime.gpu_wait_seconds={self.gpu_wait_seconds} must be >= 0")
        _require(self.max_failures >= -1, "runtime.max_failures must be >= -1 (-1 = retry forever)")
        _one_of("runtime.precision", self.precision, ("fp32", "bf16", "fp16"))
        _one_of("runtime.placement_strategy", self.placement_strategy, ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
        _require(self.cuda_graph_warmup >= 1, f"runtime.cuda_graph_warmup={self.cuda_graph_warmup} must be >= 1 "
                 "(eager steps that compile kernels and allocate optimizer state before capture)")
        _one_of("runtime.sharding", self.sharding, ("ddp", "fsdp"))
        _require(self.sharding != "fsdp" or self.precision != "fp16", "runtime.sharding=fsdp does not take "
                 "runtime.precision=fp16 (GradScaler over sharded grads is untested): use runtime.precision=bf16")
        _require(self.context_parallel >= 1, f"runtime.context_parallel={self.context_parallel} must be >= 1 "
                 "(1: each rank holds whole sequences)")
        cp = self.context_parallel
        if cp > 1:   # the world is dp * cp ranks (nsa/train/cp.py); with num_workers=-1 the trainer checks it
            _require(self.num_workers != 0, f"runtime.context_parallel={cp} needs {cp} or a multiple of {cp} "
                     "Ray workers: runtime.num_workers=0 trains in one process")
            _require(self.num_workers < 1 or self.num_workers % cp == 0, f"runtime.num_workers={self.num_workers} "
                     f"is not a multiple of runtime.context_parallel={cp}: use runtime.num_workers={cp} (or k*{cp})")
        _require(0 < self.scaler_backoff_factor < 1, "runtime.scaler_backoff_factor must be in (0, 1)")
        _require(self.scaler_growth_factor > 1, "runtime.scaler_growth_factor must be > 1")
        if self.fault:
            kind, _, at = self.fault.partition("@")
            _require(kind in ("stall", "kill", "nan", "crash", "halt") and at.isdigit(),
                     f"runtime.fault={self.fault!r}: expected '<stall|kill|nan|crash|halt>@<step>'")


@dataclass
class TrainConfig:
    steps: int = 300                 # optimizer steps
    batch_size: int = 8              # sequences per worker per micro-batch
    accumulate: int = 1              # micro-batches per optimizer step
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1        # cosine floor as a fraction of lr
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0           # 0 disables clipping (the norm is still measured)
    save_every: int = 100            # checkpoint every N optimizer steps (0: only at the end)
    keep_checkpoints: int = 3
    eval_every: int = 100
    eval_batches: int = 4
    resume: str = "auto"             # auto: continue the run of the same name if it has a checkpoint | never
    resume_from: Optional[str] = None  # explicit checkpoint directory to start from
    on_nonfinite: str = "halt"       # halt | skip
    stall_seconds: float = 600.0     # watchdog: no step_end for this long -> stack dump + stall record
    on_stall: str = "record"         # after the record: record (wait) | halt (.HALT, then exit) | restart (exit)

    def __post_init__(self) -> None:
        _positive("train", self, ("steps", "batch_size", "accumulate", "lr", "keep_checkpoints", "eval_batches",
                                  "stall_seconds"))
        _require(self.seq_len >= 2, f"train.seq_len={self.seq_len} is too small: need at least 2 tokens")
        for n in ("warmup_steps", "save_every", "eval_every", "weight_decay", "grad_clip"):
            _require(getattr(self, n) >= 0, f"train.{n}={getattr(self, n)} must be >= 0")
        _require(0 <= self.min_lr_ratio <= 1, f"train.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        _one_of("train.resume", self.resume, ("auto", "never"))
        _one_of("train.on_nonfinite", self.on_nonfinite, ("halt", "skip"))
        _one_of("train.on_stall", self.on_stall, ("record", "halt", "restart"))


@dataclass
class DataConfig:
    source: str = "parquet"          # parquet (FineWeb-Edu-format shards) | synthetic (explicit opt-in)
    # shard directory (prepare_data.py writes it) or hf://datasets/<org>/<name>/<glob>; the default is the
    # offline Python-source corpus (nsa.data.sources.OFFLINE_DATA_PATH), built on first use (auto_prepare)
    path: str = "data/offline_python"
    val_path: Optional[str] = None   # held-out shard; default: the val-*.parquet beside the train shards
    auto_prepare: bool = True        # default path missing -> build it from the offline local corpus
    tokenizer: str = "byte"          # byte | gpt2 (tiktoken, needs a local encoding file)
    tiktoken_path: Optional[str] = None
    prefetch_batches: int = 4
    shuffle_seed: Optional[int] = 0
    # share of training rows that begin with passkey documents (nsa/data/passkey.py; evaluation's format); 0: off
    passkey_fraction: float = 0.0
    passkey_mode: str = "one"        # one: a document leads the row | packed: documents fill it, keys scored

    def __post_init__(self) -> None:
        _one_of("data.source", self.source, ("parquet", "synthetic"))
        _one_of("data.tokenizer", self.tokenizer, ("byte", "gpt2"))
        _one_of("data.passkey_mode", self.passkey_mode, ("one", "packed"))
        _require(self.prefetch_batches >= 0, "data.prefetch_batches must be >= 0")
        _require(0.0 <= self.passkey_fraction <= 1.0, f"data.passkey_fraction={self.passkey_fraction} must be in "
                 "[0, 1] (the share of training rows that start with a passkey document; 0 turns it off)")
        _require(self.passkey_fraction == 0 or self.source == "parquet", "data.passkey_fraction mixes passkey rows "
                 "into parquet text: it needs data.source=parquet (or set data.passkey_fraction=0)")
        _require(bool(self.path) or self.source == "synthetic", "data.path is empty: point it at a shard directory")
        for name in ("path", "val_path"):       # a URL streams without staging: hf://datasets/..., file:///...
            if "://" in str(getattr(self, name) or ""):
                from nsa.data.sources import url_error
                err = url_error(getattr(self, name), f"data.{name}")
                _require(err is None, str(err))


@dataclass
class LoggingConfig:
    root: str = "runs"               # run directories live under root/name
    name: Optional[str] = None       # None: a unique name per launch; set it to resume a run
    log_every: int = 10              # CSV / MLflow / TensorBoard rows and console line
    heartbeat_every: int = 1
    stats_every: int = 25            # gate / selection stats (one host transfer); 0 disables
    csv: bool = True
    tensorboard: bool = True
    mlflow: bool = True
    mlflow_uri: Optional[str] = None  # None: sqlite file root/mlflow.db
    experiment: str = "nsa"
    # gate health warnings (nsa/telemetry/health.py; a warning line, never a stop); null disables a rule
    health_min_entropy: Optional[float] = 0.5   # per-layer gate entropy mean (nats; uniform = 1.0986)
    health_max_gate: Optional[float] = 0.9      # per-layer mean of the largest gate
    health_max_collapse: Optional[float] = 0.05  # per-layer share of (token, head) with max gate > 0.9
    verbose: bool = False            # show Ray's routine start-up/shutdown noise on the terminal
    # first N steps (nsa/train/debug_steps.py): module fwd/bwd ms + grad norms -> trace/, CUDA memory history -> memory/
    trace_steps: int = 0
    memory_snapshot_steps: int = 0

    def __post_init__(self) -> None:
        _positive("logging", self, ("log_every", "heartbeat_every"))
        for n in ("stats_every", "trace_steps", "memory_snapshot_steps"):   # 0: off
            _require(getattr(self, n) >= 0, f"logging.{n}={getattr(self, n)} must be >= 0 (0 turns it off)")
        if self.name is not None:
            check_run_name(self.name)


SECTIONS = {"model": ModelConfig, "nsa": NSAConfig, "runtime": RuntimeConfig, "train": TrainConfig,
            "data": DataConfig, "logging": LoggingConfig}

TOKENIZER_VOCAB = {"byte": 256, "gpt2": 50257}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    nsa: NSAConfig = field(default_factory=NSAConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        need = TOKENIZER_VOCAB[self.data.tokenizer]
        _require(self.model.vocab >= need,
                 f"model.vocab={self.model.vocab} is smaller than the {self.data.tokenizer} tokenizer's "
                 f"{need} ids: set model.vocab={need}")
        _require(self.train.seq_len >= self.nsa.l,
                 f"train.seq_len={self.train.seq_len} is shorter than nsa.l={self.nsa.l}: no compressed "
                 "token (and so no learned selection) would ever be visible; raise seq_len or lower nsa.l")
        cp = self.runtime.context_parallel
        _require(cp == 1 or self.model.attention == "nsa", f"runtime.context_parallel={cp} needs model.attention="
                 "nsa: the dense twin has no context-parallel path (set runtime.context_parallel=1)")
        _require(self.train.seq_len >= cp, f"train.seq_len={self.train.seq_len} is shorter than "
                 f"runtime.context_parallel={cp}: every rank must hold a position; lower runtime.context_parallel")
        if self.runtime.precision == "fp16" and not self.runtime.use_gpu:
            raise ConfigError("runtime.precision=fp16 needs GPUs (runtime.use_gpu=true); use bf16 or fp32 on CPU")
        _require(not self.logging.memory_snapshot_steps or self.runtime.use_gpu, "logging.memory_snapshot_steps "
                 "records CUDA memory: it needs runtime.use_gpu=true (set logging.memory_snapshot_steps=0 on CPU)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value (MLflow params, printing)."""
        return {f"{s}.{k}": v for s, sec in self.to_dict().items() for k, v in sec.items()}


# ---------------------------------------------------------------------------------------------------
# The runbooks' NSA_* environment variables. Only these still mean something; each maps to one field.
# The others (NSA_PREFILL_BATCHED, NSA_SEL_RANGES_V2, NSA_USE_SEL_PACK/MASK/VARLEN, NSA_FORCE_PARITY,
# NSA_STRICT_ASSERTS, NSA_SDPA_*, NSA_TRACE_*, NSA_FWE_Q/DOC_BATCH/WARMUP_*, NSA_DEBUG_*, ...) switched
# between buggy code paths of the old stack or worked around its hangs: prefill here is always batched,
# selection always packed, kernels are chosen once by the KernelPolicy, stalls are found by the watchdog
# and SIGUSR1 stack dumps, and Ray Data streams with prefetch. They are ignored with a warning.
ENV_MAP: dict[str, tuple[str, Any]] = {
    # name: (dotted field, transform of the parsed value)
    "NSA_ACCUM": ("train.accumulate", None),
    "NSA_BATCH_SIZE": ("train.batch_size", None),
    "NSA_LR": ("train.lr", None),
    "NSA_TOKENIZER": ("data.tokenizer", None),
    "NSA_FWE_PREFETCH": ("data.prefetch_batches", None),
    "NSA_HEARTBEAT_EVERY": ("logging.heartbeat_every", None),
    "NSA_TB_DISABLE": ("logging.tensorboard", lambda v: not v),
    "NSA_DISABLE_CSV_LOGS": ("logging.csv", lambda v: not v),
    "NSA_DISABLE_AUX_STATS": ("logging.stats_every", lambda v: 0 if v else LoggingConfig.stats_every),
    "NSA_USE_TRITON_SEL": ("nsa.backend", lambda v: "triton" if v else "torch"),
    "NSA_USE_FA2": ("nsa.allow_flash_attn", None),
    "NSA_DETECT_ANOMALY": ("runtime.detect_anomaly", None),
    "NSA_SCALER_INIT_SCALE": ("runtime.scaler_init_scale", None),
    "NSA_SCALER_GROWTH_INTERVAL": ("runtime.scaler_growth_interval", None),
    "NSA_SCALER_GROWTH_FACTOR": ("runtime.scaler_growth_factor", None),
    "NSA_SCALER_BACKOFF_FACTOR": ("runtime.scaler_backoff_factor", None),
    # Not a runbook name: Ray's own variable, set for the driver by `ray job submit`. Reading it here
    # (and only here) keeps "connect under ray job submit, else start a local instance" a config value.
    "RAY_ADDRESS": ("runtime.ray_address", str),
    # Set on the cluster nodes (ray_cluster.yaml, cluster/kuberay/*.yaml) so that jobs keep their results on
    # the shared mount without any override (nsa/launch/storage.py).
    "NSA_STORAGE_ROOT": ("runtime.storage_root", str),
}
# Variables whose value is a switch: parsed with parse_bool (BOOL_SPELLINGS) before their transform, so
# NSA_TB_DISABLE=maybe is an error instead of a silent "false".
BOOL_ENV = frozenset({"NSA_TB_DISABLE", "NSA_DISABLE_CSV_LOGS", "NSA_DISABLE_AUX_STATS", "NSA_USE_TRITON_SEL",
                      "NSA_USE_FA2", "NSA_DETECT_ANOMALY"})
# The documented spellings of a boolean, for config values and NSA_* switches alike (case-insensitive).
BOOL_SPELLINGS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
                  "on": True, "off": False}
RETIRED_ENV = ("NSA_PREFILL_BATCHED", "NSA_SEL_RANGES_V2", "NSA_SEL_RANGES_V2_MIN_S", "NSA_USE_SEL_PACK",
               "NSA_USE_SEL_MASK", "NSA_USE_SEL_VARLEN", "NSA_FORCE_PARITY", "NSA_STRICT_ASSERTS",
               "NSA_SDPA_NO_FLASH", "NSA_SDPA_FLASH_ONLY", "NSA_SDPA_AUDIT", "NSA_TRACE_GRADS",
               "NSA_TRACE_MODULE_BWD", "NSA_FWE_Q", "NSA_FWE_DOC_BATCH", "NSA_FWE_WARMUP_BATCHES",
               "NSA_FWE_WARMUP_TIMEOUT", "NSA_DEBUG_COMPARE", "NSA_DEBUG_TIMING", "NSA_ENV_STATIC",
               "NSA_USE_FA2_WIN", "NSA_USE_FA2_CMP", "NSA_STOPGRAD_GATES", "NSA_ROPE_SCALE",
               "NSA_PREFILL_TILE", "NSA_MEM_DUMP_EVERY")


# ---------------------------------------------------------------------------------------------------
def _field_types(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def parse_bool(dotted: str, value: Any) -> bool:
    """A boolean from one of BOOL_SPELLINGS (or a bool, or the ints 0/1); anything else raises."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_SPELLINGS:
        return BOOL_SPELLINGS[value.strip().lower()]
    raise ConfigError(f"{dotted}={value!r} is not a boolean: use one of {'/'.join(BOOL_SPELLINGS)}")


def _number(value: Any) -> Any:
    """Decimal and scientific notation from text (``1e-3``: YAML 1.1 reads it as a string, and Python's
    float() as the number people mean); other values unchanged."""
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            return value
    return value


def _coerce(dotted: str, value: Any, typ: Any) -> Any:
    """Coerce a YAML/CLI/env value to the field's declared type, or raise naming the field."""
    origin = get_origin(typ)
    if origin is Union:  # Optional[X]
        args = [a for a in get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            return None
        return _coerce(dotted, value, args[0])
    if typ is bool:
        return parse_bool(dotted, value)
    if isinstance(value, str) and typ is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"{dotted}: cannot parse {value!r}: {str(e).splitlines()[0]}") from None
    if typ is int:
        value = _number(value)
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ConfigError(f"{dotted}={value!r} must be an integer")
        return int(value)
    if typ is float:
        value = _number(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{dotted}={value!r} must be a number (decimal or scientific, e.g. 3e-4)")
        if not math.isfinite(value):
            raise ConfigError(f"{dotted}={value!r} must be a finite number (.inf/.nan are not accepted)")
        return float(value)
    if typ is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{dotted}={value!r} must be a string")
        return str(value)
    return value


def _suggest(name: str, options) -> str:
    near = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _split(dotted: str) -> tuple[str, str]:
    section, _, key = dotted.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r} in {dotted!r}{_suggest(section, SECTIONS)}; "
                          f"sections: {list(SECTIONS)}")
    names = {f.name for f in fields(SECTIONS[section])}
    if key not in names:
        raise ConfigError(f"unknown config key {dotted!r}{_suggest(key, names)}; "
                          f"valid keys of {section}: {sorted(names)}")
    return section, key


def parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items:
        if "=" not in it:
            raise ConfigError(f"override {it!r} must look like section.key=value (e.g. train.steps=100)")
        k, v = it.split("=", 1)
        _split(k.strip())
        out[k.strip()] = v
    return out


def load_yaml(path: str | os.PathLike, warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Flatten a YAML profile to dotted keys, rejecting unknown sections and keys."""
    warn = warn or _warn
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist (profiles live in pipelines/configs/)")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}: YAML syntax error at{where}: {what}") from None
    if raw is None:
        warn(f"profile {p} is empty: every field keeps its default (unless set by NSA_* or overrides)")
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections {list(SECTIONS)}")
    flat: dict[str, Any] = {}
    for section, body in raw.items():
        if section not in SECTIONS:
            raise ConfigError(f"{p}: unknown config section {section!r}{_suggest(str(section), SECTIONS)}; "
                              f"sections: {list(SECTIONS)}")
        if body is None:
            warn(f"profile {p}: section {section!r} is empty: its fields keep their defaults")
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{p}: section {section!r} must be a mapping")
        for k, v in body.items():
            _split(f"{section}.{k}")
            flat[f"{section}.{k}"] = v
    return flat


def _warn(msg: str) -> None:
    """Config warnings go to stderr at once, one line each (resolve_config runs before any logging setup)."""
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def retired_env_warnings(env: Mapping[str, str] | None = None) -> list[str]:
    """One line per retired NSA_* variable that is set (every entry point warns, config or not)."""
    env = os.environ if env is None else env
    return [f"{n} is retired and ignored (see nsa/config/ ENV_MAP)" for n in RETIRED_ENV if n in env]


def read_env(env: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The documented NSA_* variables as dotted values, plus warnings for retired ones. An empty value
    counts as unset (``NSA_LR= cmd`` is how a shell clears a variable for one command)."""
    values: dict[str, Any] = {}
    warnings = retired_env_warnings(env)
    for name, (dotted, fn) in ENV_MAP.items():
        if env.get(name, "") == "":
            continue
        section, key = _split(dotted)
        where = f"{dotted} (from ${name})"
        raw = env[name]
        if name in BOOL_ENV:
            parsed: Any = parse_bool(f"${name}", raw)
        elif dotted in ("runtime.ray_address", "runtime.storage_root"):
            parsed = raw                      # an address or a path, not YAML
        else:
            try:
                parsed = yaml.safe_load(raw)
            except yaml.YAMLError as e:
                raise ConfigError(f"${name}={raw!r} cannot be parsed for {dotted}: "
                                  f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
        if fn is not None:
            parsed = fn(parsed)
        values[dotted] = _coerce(where, parsed, _field_types(SECTIONS[section])[key])
    return values, warnings


def resolve_config(yaml_path: str | None = None, overrides: list[str] | None = None,
                   env: Mapping[str, str] | None = None,
                   warn: Callable[[str], None] = _warn) -> tuple[RunConfig, dict[str, str]]:
    """Build the RunConfig: default < YAML < NSA_* env < overrides. Returns (config, source per field).
    Retired NSA_* variables are reported through ``warn`` (default: one ``warning:`` line on stderr)."""
    env = os.environ if env is None else env
    layers: list[tuple[str, dict[str, Any]]] = []
    if yaml_path:
        layers.append((f"yaml:{yaml_path}", load_yaml(yaml_path, warn)))
    env_vals, env_warnings = read_env(env)
    for w in env_warnings:
        warn(w)
    layers.append(("env", env_vals))
    layers.append(("cli", parse_overrides(list(overrides or []))))
    merged: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    sources = {f"{s}.{f.name}": "default" for s, cls in SECTIONS.items() for f in fields(cls)}
    for origin, vals in layers:
        for dotted, v in vals.items():
            s, k = _split(dotted)
            merged[s][k] = _coerce(dotted, v, _field_types(SECTIONS[s])[k])
            sources[dotted] = origin
    cfg = RunConfig(**{s: SECTIONS[s](**merged[s]) for s in SECTIONS})
    return cfg, sources


def config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (checkpoints, Ray loop config)."""
    secs = {}
    for s, cls in SECTIONS.items():
        body = dict(d.get(s, {}))
        hints = _field_types(cls)
        for k in body:
            _split(f"{s}.{k}")
        secs[s] = cls(**{k: _coerce(f"{s}.{k}", v, hints[k]) for k, v in body.items()})
    return RunConfig(**secs)


def dump_yaml(cfg: RunConfig, sources: dict[str, str] | None = None) -> str:
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if sources:
        changed = {k: v for k, v in sources.items() if v != "default"}
        if changed:
            text += "# sources (non-default fields):\n" + "".join(f"#   {k}: {v}\n" for k, v in sorted(changed.items()))
    return text


def format_config(cfg: RunConfig, sources: dict[str, str]) -> str:
    """One line per field with its source; printed once at start-up."""
    width = max(len(k) for k in sources)
    return "\n".join(f"  {k:<{width}} = {v!r:<24} [{sources.get(k, 'default')}]" for k, v in cfg.flat().items())
