"""Training data as Ray Data datasets, plus a plain iterator for bare-PyTorch benchmarks/tests.

Ray pipeline: `read_parquet(files).select_columns(["text"])` -> `map_batches(tokenize_and_pack,
batch_format="numpy", batch_size=~64 docs)` -> rows `{"input_ids": int64 [seq_len+1]}`. The Trainer
splits the train dataset across workers (streaming split); the loop iterates with
`iter_torch_batches(batch_size=..., prefetch_batches=...)` and measures fetch time itself (the old
stack's NSA_FWE_PREFETCH / NSA_FWE_Q map to `prefetch_batches`; NSA_FWE_DOC_BATCH to `doc_batch`).
Each map_batches call drops its own incomplete tail (< seq_len+1 tokens per ~64 documents).
The files are local paths or parquet URLs (`hf://datasets/...`, `file:///...`): a URL list is read as
`read_parquet(paths, filesystem=<its fsspec filesystem>)`, the rest of the pipeline and the split are
the same (nsa.data.sources).

The 2-core deadlock (docs/ray.md): Train workers hold their CPUs in a placement group and
Ray Data's read/map tasks need CPUs too. On a small machine (e.g. `ray.init(num_cpus=2)` with two
workers) the dataset never produces a batch if each worker reserves a whole CPU. Train workers must
use fractional CPUs (`ScalingConfig(resources_per_worker={"CPU": 0.5})`) so that at least one CPU
stays free for these tasks; `data_num_cpus` below sets what each data task asks for.

Ray is imported inside the functions only: `import nsa.data.ray_data` does not import ray.
"""
from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np

from nsa.data.packing import StreamPacker, encode_stream, tokenize_and_pack
from nsa.data.shards import check_data_path, resolve_val_files
from nsa.data.sources import open_parquet, read_parquet_args
from nsa.data.tokenizers import Tokenizer, get_tokenizer


def _resolve_tokenizer(tokenizer: str | Tokenizer, tiktoken_path: str | os.PathLike | None) -> Any:
    if isinstance(tokenizer, str):
        return get_tokenizer(tokenizer, tiktoken_path=tiktoken_path)
    if not all(hasattr(tokenizer, a) for a in ("eos_id", "encode_batch")):
        raise ValueError(f"tokenizer must be a name ('byte'/'gpt2') or a Tokenizer object, got "
                         f"{tokenizer!r}")
    return tokenizer


def _unpack_cfg(data: Any) -> dict[str, Any]:
    """Accept a path or a DataConfig-like object (duck-typed: path/data_path, val_path, ...)."""
    if isinstance(data, (str, os.PathLike)):
        return {"data_path": data}
    path = getattr(data, "path", None) or getattr(data, "data_path", None)
    if path is None:
        raise ValueError(f"build_datasets: first argument must be a data path or a config with a "
                         f"'path' attribute, got {type(data).__name__}")
    out: dict[str, Any] = {"data_path": path}
    for name in ("val_path", "tiktoken_path", "shuffle_seed", "doc_batch"):
        if getattr(data, name, None) is not None:
            out[name] = getattr(data, name)
    tok = getattr(data, "tokenizer", None)
    if tok is not None:
        out["tokenizer_name"] = tok
    return out


def _packed(files: Sequence[str], seq_len: int, tokenizer: Any, doc_batch: int,
            shuffle_seed: int | None, data_num_cpus: float) -> Any:
    import ray.data

    shuffle = None
    if shuffle_seed is not None:
        shuffle = ray.data.FileShuffleConfig(seed=int(shuffle_seed))
    # select_columns (not read_parquet(columns=...), deprecated in 2.60) is pushed down into the
    # parquet read, so only `text` is decoded.
    paths, fs = read_parquet_args(files)   # local paths (fs None) or paths inside a URL's fsspec filesystem
    ds = ray.data.read_parquet(paths, filesystem=fs, shuffle=shuffle).select_columns(["text"])
    return ds.map_batches(tokenize_and_pack, batch_format="numpy", batch_size=doc_batch,
                          fn_kwargs={"tokenizer": tokenizer, "seq_len": int(seq_len)},
                          num_cpus=data_num_cpus)


def build_datasets(data_path: Any, seq_len: int, tokenizer_name: str | Tokenizer = "byte",
                   tiktoken_path: str | os.PathLike | None = None,
                   val_path: str | os.PathLike | None = None, shuffle_seed: int | None = None, *,
                   doc_batch: int = 64, data_num_cpus: float = 1.0) -> tuple[Any, Any | None]:
    """(train_ds, val_ds | None) of rows {"input_ids": int64 [seq_len+1]}.

    `data_path`: a prepared directory (see nsa.data.shards), a directory of FineWeb-Edu parquet
    files, one parquet file, a parquet URL streamed without staging (`hf://datasets/<org>/<name>/
    <folder or glob>`, `file:///abs/<folder or glob>`; see nsa.data.sources), or a DataConfig-like
    object carrying `path` (+ optional `val_path`, `tokenizer`, `tiktoken_path`, `shuffle_seed`,
    `doc_batch`). The held-out set comes from
    `val_path` or else the directory's `val-*.parquet`. `shuffle_seed` shuffles the train file
    order (row-level shuffling belongs to iteration: `local_shuffle_buffer_size`).
    Needs an initialized Ray (or lets Ray Data start a local one).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if doc_batch < 1 or data_num_cpus <= 0:
        raise ValueError(f"doc_batch must be >= 1 and data_num_cpus > 0, got {doc_batch}, "
                         f"{data_num_cpus}")
    cfg = _unpack_cfg(data_path)
    tokenizer_name = cfg.get("tokenizer_name", tokenizer_name)
    tiktoken_path = cfg.get("tiktoken_path", tiktoken_path)
    val_path = cfg.get("val_path", val_path)
    shuffle_seed = cfg.get("shuffle_seed", shuffle_seed)
    doc_batch = int(cfg.get("doc_batch", doc_batch))
    tok = _resolve_tokenizer(tokenizer_name, tiktoken_path)
    train_files = check_data_path(cfg["data_path"])
    val_files = resolve_val_files(cfg["data_path"], val_path)
    train_ds = _packed(train_files, seq_len, tok, doc_batch, shuffle_seed, data_num_cpus)
    val_ds = _packed(val_files, seq_len, tok, doc_batch, None, data_num_cpus) if val_files else None
    return train_ds, val_ds


def iter_packed_batches(files: Sequence[str | os.PathLike], seq_len: int,
                        tokenizer: str | Tokenizer = "byte", batch_size: int = 8, *,
                        doc_batch: int = 64, repeat: bool = False, skip_batches: int = 0,
                        tiktoken_path: str | os.PathLike | None = None) -> Iterator[np.ndarray]:
    """Yield int64 [batch_size, seq_len+1] batches from parquet files without Ray.

    Reads `text` in chunks of `doc_batch` documents, packs with a carry-over tail (no tokens lost
    between chunks) and drops only the final incomplete batch. `repeat=True` cycles over the files
    forever (epochs); `skip_batches` fast-forwards by re-reading (the training loop seeks instead:
    nsa/data/position.py).
    """
    if batch_size < 1 or doc_batch < 1 or skip_batches < 0:
        raise ValueError(f"batch_size and doc_batch must be >= 1 and skip_batches >= 0, got "
                         f"{batch_size}, {doc_batch}, {skip_batches}")
    if not files:
        raise ValueError("iter_packed_batches: files is empty; pass check_data_path(<dir>)")
    tok = _resolve_tokenizer(tokenizer, tiktoken_path)
    packer = StreamPacker(seq_len)  # validates seq_len; holds the token tail
    pending: list[np.ndarray] = []
    n_pending = 0
    emitted = 0
    while True:
        epoch_rows = 0
        for f in files:
            for rb in open_parquet(f).iter_batches(batch_size=doc_batch, columns=["text"]):
                texts = [t for t in rb.column(0).to_pylist() if isinstance(t, str)]
                rows = packer.push(encode_stream(tok, texts))  # [n, seq_len+1]
                if rows.size:
                    epoch_rows += rows.shape[0]
                    pending.append(rows)
                    n_pending += rows.shape[0]
                while n_pending >= batch_size:
                    block = np.concatenate(pending) if len(pending) > 1 else pending[0]
                    batch, rest = block[:batch_size], block[batch_size:]
                    pending, n_pending = ([rest] if rest.shape[0] else []), rest.shape[0]
                    emitted += 1
                    if emitted > skip_batches:
                        yield batch
        if not repeat:
            return
        if epoch_rows == 0 and packer.pending_tokens == 0:
            raise ValueError("iter_packed_batches: the files hold no text; repeat would loop "
                             "forever")


# ----------------------------------------------------------------------------------------------
# Seekable per-rank streaming for the training loop (nsa/data/position.py): each Train worker runs
# its own Ray Data pipeline over its read units, so its stream can start at a recorded position.
# ----------------------------------------------------------------------------------------------

def tokenize_units(batch: dict[str, np.ndarray], files: Sequence[str], tokenizer: Any) -> dict[str, np.ndarray]:
    """Ray Data `map_batches` fn: units {"shard","row_group","lo","hi": [n]} -> the same plus "tokens"
    and "ends" [n] (bytes of int64 arrays: the unit's token stream and its per-document ends)."""
    from nsa.data.position import Unit, read_unit, tokenize_texts
    tokens, ends = [], []
    for s, g, lo, hi in zip(batch["shard"], batch["row_group"], batch["lo"], batch["hi"]):   # per unit
        t, e = tokenize_texts(tokenizer, read_unit(files[int(s)], Unit(int(s), int(g), int(lo), int(hi))))
        tokens.append(t.tobytes())
        ends.append(e.tobytes())
    return {**{k: batch[k] for k in ("shard", "row_group", "lo", "hi")},
            "tokens": np.array(tokens, dtype=object), "ends": np.array(ends, dtype=object)}


def iter_ray_units(files: Sequence[str], units: Sequence[Any], tokenizer: Any, *, prefetch_batches: int = 4,
                   data_num_cpus: float = 1.0) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
    """(unit, tokens int64 [n], doc ends int64 [hi-lo]) for `units` in order, read and tokenized by Ray
    Data tasks (streaming, `prefetch_batches` units ahead); the source of a RankEpoch under Ray."""
    import dataclasses

    import ray.data

    from nsa.data.position import Unit
    if not units:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True          # units come back in reading order
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ds = ray.data.from_items([dataclasses.asdict(u) for u in units], override_num_blocks=min(len(units), 1024))
    ds = ds.map_batches(tokenize_units, batch_format="numpy", batch_size=1, num_cpus=data_num_cpus,
                        fn_kwargs={"files": [str(f) for f in files], "tokenizer": tokenizer})
    for b in ds.iter_batches(batch_size=1, batch_format="numpy", prefetch_batches=prefetch_batches):
        u = Unit(int(b["shard"][0]), int(b["row_group"][0]), int(b["lo"][0]), int(b["hi"][0]))
        yield u, np.frombuffer(b["tokens"][0], dtype=np.int64), np.frombuffer(b["ends"][0], dtype=np.int64)
