"""Self-describing checkpoints (docs/design.md, principle 6), loadable with ``torch.load(weights_only=True)``.

A checkpoint is a directory holding ``checkpoint.pt`` and ``meta.json``:

    checkpoint.pt   {"format", "step", "model", "optimizer", "scheduler", "scaler", "rng", "data",
                     "config", "metrics"}  -- tensors, numbers, strings, lists/tuples/dicts only
                    ("data": epoch counters + per-rank seek positions, see data_state)
    meta.json       {"format", "step", "created", "files": {"checkpoint.pt": bytes}, "data": summary}
                    (human-readable; lets tools pick the latest cheaply and tell a complete copy from a part)

The loop writes it into a temp dir; ``persist_checkpoint`` moves it into the run dir as
``<run dir>/checkpoint_<step:08d>/`` atomically (copied to a hidden temp dir beside it, fsynced, renamed):
the directory is complete or absent. Under Ray it is the ``checkpoint_upload_fn`` of
``ray.train.report`` (Ray's own upload copies file by file into the final name). Completeness is also
a property a directory can be checked for (``checkpoint_problem``: meta.json parses and every file it
lists has the listed size), for directories written by other code or older versions. Only complete
directories count as checkpoints (``list_checkpoints``); ``scan_checkpoints`` also returns the
incomplete ones with the reason, and ``set_aside`` renames one out of the ``checkpoint_*`` namespace.
``prune_checkpoints`` keeps the newest ``train.keep_checkpoints`` complete ones. Nothing here imports Ray.

Rules: never overwrite an existing checkpoint (``save_checkpoint`` raises ``FileExistsError``); a
complete but unreadable file raises ``CheckpointError`` naming the file.
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch

from nsa.fileio import atomic_write_text, fsync_dir

CKPT_FILE = "checkpoint.pt"
META_FILE = "meta.json"
FORMAT = 1
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "scheduler", "scaler", "rng", "data", "config")
_DIR_RE = re.compile(r"^checkpoint_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt or incompatible; the message names the file."""


# nsa vs the dense twin (model.attention): a checkpoint records its kind in its config (checkpoints
# written before the field existed are NSA); loading the other kind fails with one line naming both
# instead of a strict load_state_dict listing dozens of missing keys.
ATTENTION_KINDS = ("nsa", "dense")


class AttentionKindError(CheckpointError):
    """A checkpoint of one attention kind was loaded into a model of the other."""


def checkpoint_kind(state: Mapping[str, Any]) -> str:
    """model.attention of a checkpoint state dict (its stored config); "nsa" when not recorded."""
    cfg = state.get("config") or {}
    model = (cfg.get("model") or {}) if isinstance(cfg, Mapping) else {}
    return str(model.get("attention", "nsa"))


def model_kind(model: torch.nn.Module) -> str:
    """model.attention of a (possibly DDP-wrapped) TinyLM; "nsa" for models that do not say."""
    inner = getattr(model, "module", model)
    return str(getattr(inner, "attention", "nsa"))


def check_attention_kind(model: torch.nn.Module, state: Mapping[str, Any], where: str = "checkpoint") -> None:
    """Raise AttentionKindError (one line, both kinds named) when `state` holds the other kind."""
    have, want = checkpoint_kind(state), model_kind(model)
    if have != want:
        raise AttentionKindError(
            f"{where} holds a model.attention={have!r} model but this model is model.attention={want!r}: "
            f"build it with model.attention={have} (or load a {want} checkpoint)")


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


# ------------------------------------------------------------------------------------------ RNG state
def capture_rng() -> dict[str, Any]:
    """torch (CPU + every CUDA device), numpy and Python RNG states as weights_only-safe values."""
    np_state = np.random.get_state()
    ver, keys, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": ver, "keys": list(keys), "gauss": gauss},
    }


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = rng["python"]
    random.setstate((p["version"], tuple(p["keys"]), p["gauss"]))


# ------------------------------------------------------------------------------------------ data position
# state["data"]: {"epoch", "batches_in_epoch", "samples_seen"} (ints; rank 0's epoch counters, kept for
# tools and for the fast-forward fallback) and, where the data can seek, "ranks": one DataPosition state
# per rank (nsa/data/position.py: epoch, batches_in_epoch, shard, row_group, offset, carry tensor).
def data_state(data: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's data entry from the loop's position (DataPosition objects -> weights_only dicts)."""
    out: dict[str, Any] = {k: int(v) for k, v in data.items() if k != "ranks"}
    if data.get("ranks") is not None:
        out["ranks"] = [r.to_state() if hasattr(r, "to_state") else dict(r) for r in data["ranks"]]
    return out


def data_summary(data: Mapping[str, Any]) -> dict[str, Any]:
    """meta.json's readable copy of the data position (the carry as its length)."""
    from nsa.data.position import DataPosition
    out: dict[str, Any] = {k: v for k, v in data.items() if k != "ranks"}
    if data.get("ranks") is not None:
        out["ranks"] = [DataPosition.from_state(r).describe() for r in data["ranks"]]
    return out


def rank_positions(data: Mapping[str, Any], world_size: int) -> tuple[Optional[list[Any]], Optional[str]]:
    """(one DataPosition per rank, None) when the checkpoint recorded them for this world size, else
    (None, the one-line reason the resume fast-forwards by re-reading instead)."""
    from nsa.data.position import DataPosition
    ranks = data.get("ranks")
    skip = f"fast-forwarding {int(data.get('batches_in_epoch', 0))} batches of epoch {int(data.get('epoch', 0))}"
    if ranks is None:
        return None, f"resume: the checkpoint records no data position (written before seek-resume): {skip}"
    if len(ranks) != world_size:
        return None, (f"resume: the checkpoint's data position is for {len(ranks)} ranks, this run has "
                      f"{world_size}: {skip}")
    return [DataPosition.from_state(r) for r in ranks], None


# ------------------------------------------------------------------------------------------ save
def build_state(*, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                scaler: torch.amp.GradScaler, step: int, data: dict[str, Any], config: dict[str, Any],
                metrics: Optional[dict[str, float]] = None) -> dict[str, Any]:
    """Collect everything needed to continue training. ``model`` must be the unwrapped module (no
    ``module.`` prefixes from DDP) so weights load into a plain TinyLM for inference."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return {
        "format": FORMAT,
        "step": int(step),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "rng": capture_rng(),
        "data": data_state(data),
        "config": config,
        "metrics": {k: float(v) for k, v in (metrics or {}).items()},
    }


def save_checkpoint(directory: str | os.PathLike, state: dict[str, Any], extra_files: tuple[str, ...] | list[str] = ()
                    ) -> Path:
    """Write ``state`` to ``directory/checkpoint.pt`` (+ meta.json, last). Refuses to overwrite. Each file
    goes to a temp name, is fsynced and renamed; meta.json records checkpoint.pt's size, so a copy of
    the directory made elsewhere (Ray's persist) can be checked for completeness. ``extra_files``: files
    already in ``directory`` (a sharded checkpoint's DCP shards, nsa/train/fsdp.py) listed with theirs."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    target = d / CKPT_FILE
    if target.exists():
        raise FileExistsError(f"refusing to overwrite existing checkpoint {target}")
    tmp = d / (CKPT_FILE + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)                # atomic: readers never see a half-written file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sizes = {n: (d / n).stat().st_size for n in extra_files}
    meta = {"format": state["format"], "step": state["step"], "created": time.time(),
            "files": {**sizes, CKPT_FILE: target.stat().st_size}}
    if isinstance(state.get("data"), Mapping):
        meta["data"] = data_summary(state["data"])
    atomic_write_text(d / META_FILE, json.dumps(meta))
    fsync_dir(d)
    return target


# ------------------------------------------------------------------------------------------ find / load
def _step_of(d: Path) -> Optional[int]:
    meta = d / META_FILE
    if meta.is_file():
        try:
            return int(json.loads(meta.read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):   # any meta.json not of ours
            pass
    m = _DIR_RE.match(d.name)
    return int(m.group(1)) if m else None


def checkpoint_problem(d: str | os.PathLike) -> Optional[str]:
    """None if checkpoint dir ``d`` is complete, else why not (one phrase). A meta.json without a file
    list (written before sizes were recorded) counts as complete when checkpoint.pt exists; loading it
    is then the only check."""
    d = Path(d)
    meta_f = d / META_FILE
    if not (d / CKPT_FILE).exists():
        return f"no {CKPT_FILE} (the write stopped before it)"
    if not meta_f.is_file():
        return f"no {META_FILE} (the write stopped before it)"
    try:
        meta = json.loads(meta_f.read_text())
        files = meta.get("files", {})
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{META_FILE} is unreadable (a partial write)"
    # edited or foreign meta.json ({"checkpoint.pt": "abc"}, a list, "../x"): incomplete, not a traceback
    if not isinstance(files, dict) or not all(
            isinstance(n, str) and n and "/" not in n and n not in (".", "..")
            and type(sz) is int and sz >= 0 for n, sz in files.items()):
        return f"{META_FILE} 'files' is not a map of file name to byte count (edited or foreign)"
    for name, size in files.items():
        f = d / name
        have = f.stat().st_size if f.is_file() else None
        if have is None:
            return f"{name} is missing"
        if have != size:
            return f"{name} has {have} of {size} bytes (an interrupted write)"
    return None


def scan_checkpoints(run_dir: str | os.PathLike) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """(complete checkpoints as (step, dir) ascending by step, incomplete ones as (dir, reason))."""
    root = Path(run_dir)
    if not root.is_dir():
        return [], []
    good, bad = [], []
    for d in sorted(root.iterdir()):
        if not (d.is_dir() and _DIR_RE.match(d.name)):
            continue
        why = checkpoint_problem(d)
        step = _step_of(d)
        if why is None and step is not None:
            good.append((step, d))
        else:
            bad.append((d, why or "no step"))
    return sorted(good), bad


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint directory directly under ``run_dir``, ascending by step."""
    return scan_checkpoints(run_dir)[0]


def persist_checkpoint(src: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Copy checkpoint dir ``src`` to ``target`` atomically: a hidden temp dir beside ``target`` is
    filled, fsynced and renamed. A failure (ENOSPC, EROFS) removes the temp dir and leaves no
    ``target``. An existing complete ``target`` is never replaced; an incomplete one is set aside. A
    ``src`` beside ``target`` (a sharded checkpoint staged in the run dir) is renamed, not copied."""
    import shutil
    target = Path(target)
    if target.exists():
        if checkpoint_problem(target) is None:
            raise FileExistsError(f"refusing to overwrite existing checkpoint {target}")
        set_aside(target)
    if Path(src).resolve().parent == target.resolve().parent:
        for f in Path(src).iterdir():            # rank 0 fsynced only its own files
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(src)
        os.replace(src, target)
        fsync_dir(target.parent)
        return target
    tmp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        for f in sorted(Path(src).iterdir()):
            shutil.copyfile(f, tmp / f.name)
            with open(tmp / f.name, "rb+") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    return target


_PRUNING = ".pruning-"


def prune_checkpoints(run_dir: str | os.PathLike, keep: int,
                      protect: tuple[str | os.PathLike, ...] = ()) -> list[Path]:
    """Delete the complete checkpoints of ``run_dir`` older than its newest ``keep`` (at least 1: the newest
    complete one is never deleted), except ``protect``ed dirs; whoever wrote or registered them. Each is
    renamed out of the ``checkpoint_*`` namespace before it is removed, so a crash mid-delete leaves no
    partial checkpoint, only a ``.pruning-*`` dir that the next prune removes. Incomplete dirs are left
    alone (``set_aside`` keeps them for inspection). Returns the dirs deleted, oldest first."""
    import shutil
    root = Path(run_dir)
    if root.is_dir():
        for left in root.glob(_PRUNING + "checkpoint_*"):
            shutil.rmtree(left, ignore_errors=True)
    good = list_checkpoints(root)
    keep_dirs = {d.resolve() for _, d in good[-max(1, int(keep)):]} | {Path(p).resolve() for p in protect}
    removed = []
    for _, d in good:
        if d.resolve() in keep_dirs:
            continue
        doomed = d.with_name(f"{_PRUNING}{d.name}-{os.getpid()}")
        os.replace(d, doomed)
        shutil.rmtree(doomed)
        removed.append(d)
    if removed:
        fsync_dir(root)
    return removed


def set_aside(d: str | os.PathLike) -> Path:
    """Rename an incomplete checkpoint dir to ``.incomplete-<name>-<time>`` beside it (kept for inspection,
    out of the ``checkpoint_*`` namespace, so the step can be saved again as a fresh directory)."""
    d = Path(d)
    dest = d.with_name(f".incomplete-{d.name}-{int(time.time() * 1000)}")
    os.replace(d, dest)
    return dest


def resolve_checkpoint_file(path: str | os.PathLike) -> Path:
    """A checkpoint file, a checkpoint dir, or a run dir (-> its latest checkpoint) -> the .pt file."""
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if not p.exists():
        raise CheckpointError(f"checkpoint path {str(p)!r} does not exist")
    if (p / CKPT_FILE).is_file():
        return p / CKPT_FILE
    found, partial = scan_checkpoints(p)
    if found:
        return found[-1][1] / CKPT_FILE
    if partial:
        d, why = partial[-1]
        raise CheckpointError(f"{d / CKPT_FILE} is incomplete ({why}) and {str(p)!r} holds no complete "
                              "checkpoint: start a fresh run or pass an intact checkpoint")
    raise CheckpointError(f"no {CKPT_FILE} in {str(p)!r} and no checkpoint_* directories under it: "
                          "pass a run directory or a checkpoint directory")


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False,
                    full_model: bool = True) -> dict[str, Any]:
    """Load with ``weights_only=True``; raise CheckpointError naming the file if it is unreadable or
    lacks required keys. ``mmap=True`` is a cheap structural check (tensor bytes are not read). A sharded
    checkpoint's "model" is read whole from its shards unless ``mmap`` or ``full_model=False`` (the
    trainer, which loads its own shards: restore_training_state)."""
    f = resolve_checkpoint_file(path)
    try:
        state = torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # zip/pickle/EOF/unpickling errors all mean the same thing to the user
        raise CheckpointError(f"checkpoint file {f} is corrupt or not a weights-only torch checkpoint "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {f} does not hold a dict (got {type(state).__name__})")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint file {f} lacks keys {missing}: not written by nsa.train")
    if state["format"] != FORMAT:
        raise CheckpointError(f"checkpoint file {f} has format {state['format']}, this code reads {FORMAT}")
    if state.get("sharded"):       # model + optimizer are DCP shards beside it (nsa/train/fsdp.py)
        state["sharded"]["dir"] = str(f.parent)
        if full_model and not mmap:
            from nsa.train.fsdp import full_model_state
            try:
                state["model"] = full_model_state(f.parent)
            except Exception as e:
                raise CheckpointError(f"sharded checkpoint {f.parent} cannot be read ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return state


def verify_checkpoint(path: str | os.PathLike) -> tuple[Path, int]:
    """Driver-side preflight: (file, step) if ``path`` resolves to a readable checkpoint."""
    f = resolve_checkpoint_file(path)
    state = load_checkpoint(f, mmap=True)
    return f, int(state["step"])


def load_model_weights(model: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load the checkpoint's model weights (strict) into an unwrapped model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    check_attention_kind(model, state)
    if state.get("sharded") and not state["model"]:     # read with full_model=False
        from nsa.train.fsdp import load_sharded
        load_sharded(state, model, None)
        return
    model.load_state_dict(state["model"], strict=True)


def restore_training_state(state: dict[str, Any], *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           scheduler: Any, scaler: torch.amp.GradScaler, rng: bool = True) -> int:
    """Restore everything but the data position; returns the step the checkpoint was taken after."""
    from nsa.train.fsdp import is_sharded, load_sharded, load_whole
    if state.get("sharded"):            # DCP shards, resharded to this model (sharded or whole)
        check_attention_kind(model, state)
        load_sharded(state, model, optimizer)
    elif is_sharded(model):             # a runtime.sharding=ddp checkpoint continued under fsdp
        check_attention_kind(model, state)
        load_whole(state, model, optimizer)
    else:
        load_model_weights(model, state)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    if rng:
        restore_rng(state["rng"])
    return int(state["step"])
