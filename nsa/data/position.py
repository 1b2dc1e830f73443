"""Where a rank stands in its training data, and continuing from there without re-reading.

Read units: a rank reads one row group of one parquet shard at a time (docs [lo, hi), all of them
except after a seek). An epoch's units are the shards in their order (shuffled per epoch when
`shuffle_seed` is set: a permutation seeded by (seed, epoch)), each shard's row groups in order;
rank r of W takes units r, r+W, r+2W, ... So a rank's token stream depends only on the files, the
epoch, r and W, not on how fast other ranks read (which a dynamic split would bring in), and the
stream is the same whatever reads it: in process (LocalEnv, `iter_local_units`) or Ray Data tasks
(nsa.data.ray_data.iter_ray_units). Fewer row groups than ranks: each is cut into W document ranges.

Position (`DataPosition`, one per rank, kept in the checkpoint): epoch, batches consumed in that
epoch, and the packer's position after the last consumed batch (nsa.data.packing.SeekPacker):
(shard, row_group, offset, carry). Resume = a packer holding `carry`, fed docs [offset, hi) of that
row group and then the rank's later units of the epoch: the documents before `offset` are never read
again, nothing consumed is tokenized again.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from nsa.data.packing import doc_ends, encode_stream
from nsa.data.sources import open_parquet

# Documents read (and so tokenized) by this process's unit readers: tests spy on it to show that a
# resume does not read what the checkpoint had consumed.
READ_COUNTER = {"docs": 0, "units": 0}


class SeekError(ValueError):
    """A recorded position does not fit the data (other files, fewer row groups, other world size)."""


@dataclass(frozen=True)
class Unit:
    shard: int          # index into the train file list
    row_group: int
    lo: int             # first document (row) of the row group to read
    hi: int             # one past the last


@dataclass
class DataPosition:
    """One rank's data position; `shard == -1` means the start of `epoch` (nothing read yet)."""

    epoch: int = 0
    batches_in_epoch: int = 0
    shard: int = -1
    shard_name: str = ""
    row_group: int = 0
    offset: int = 0
    carry: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # int64 [k]

    def to_state(self) -> dict[str, Any]:
        """weights_only-safe dict for checkpoint.pt (the carry as an int64 tensor)."""
        import torch
        return {"epoch": int(self.epoch), "batches_in_epoch": int(self.batches_in_epoch),
                "shard": int(self.shard), "shard_name": str(self.shard_name),
                "row_group": int(self.row_group), "offset": int(self.offset),
                "carry": torch.from_numpy(np.ascontiguousarray(self.carry, dtype=np.int64))}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "DataPosition":
        carry = d.get("carry")
        carry = np.zeros(0, np.int64) if carry is None else np.asarray(
            carry.numpy() if hasattr(carry, "numpy") else carry, dtype=np.int64).reshape(-1)
        return cls(int(d["epoch"]), int(d["batches_in_epoch"]), int(d["shard"]), str(d.get("shard_name", "")),
                   int(d["row_group"]), int(d["offset"]), carry)

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary (meta.json, heartbeats): the carry as its length only."""
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch, "shard": self.shard_name or None,
                "row_group": self.row_group, "offset": self.offset, "carry_tokens": int(self.carry.size)}


def row_group_rows(files: Sequence[str | os.PathLike]) -> list[list[int]]:
    """Rows per row group of every file: footer reads only."""
    out = []
    for f in files:
        md = open_parquet(f).metadata
        out.append([md.row_group(g).num_rows for g in range(md.num_row_groups)])
    return out


def plan_units(rg_rows: Sequence[Sequence[int]], epoch: int, rank: int, world: int,
               shuffle_seed: int | None = None) -> list[Unit]:
    """This rank's units of `epoch`, in reading order (see module doc)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world_size={world}), got {rank}")
    order = np.arange(len(rg_rows))
    if shuffle_seed is not None:
        order = np.random.default_rng([int(shuffle_seed), int(epoch)]).permutation(len(rg_rows))
    units = [Unit(int(s), g, 0, n) for s in order for g, n in enumerate(rg_rows[s]) if n > 0]
    if 0 < len(units) < world:      # too few row groups for the ranks: W document ranges each
        split = []
        for u in units:
            edges = np.linspace(u.lo, u.hi, world + 1).astype(np.int64)              # [world+1]
            split += [Unit(u.shard, u.row_group, int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]
        units = split
    return units[rank::world]


def seek_units(units: Sequence[Unit], pos: DataPosition, files: Sequence[str | os.PathLike]) -> list[Unit]:
    """The units left after `pos`: docs [offset, hi) of its row group, then the ones after it."""
    if pos.shard < 0:
        return list(units)
    if pos.shard >= len(files) or (pos.shard_name and Path(str(files[pos.shard])).name != pos.shard_name):
        have = Path(str(files[pos.shard])).name if pos.shard < len(files) else "none"
        raise SeekError(f"the checkpoint's data position names shard {pos.shard} {pos.shard_name!r}, the data "
                        f"path has {have!r} there")
    for i, u in enumerate(units):
        if u.shard == pos.shard and u.row_group == pos.row_group and u.lo <= pos.offset <= u.hi:
            rest = [Unit(u.shard, u.row_group, pos.offset, u.hi)] if pos.offset < u.hi else []
            return rest + list(units[i + 1:])
    raise SeekError(f"the checkpoint's data position (shard {pos.shard_name!r}, row group {pos.row_group}, "
                    f"offset {pos.offset}) is not among this rank's units of epoch {pos.epoch}")


def read_unit(path: str | os.PathLike, unit: Unit) -> list[Any]:
    """The `text` values of docs [lo, hi) of one row group (None for nulls). A shard damaged after the
    preflight (its cached verdict still says clean) fails here: DataError naming the shard and row group."""
    try:
        table = open_parquet(path).read_row_group(unit.row_group, columns=["text"])
        col = table.column(0).slice(unit.lo, unit.hi - unit.lo).to_pylist()
    except Exception as exc:   # pyarrow's decode errors (OSError, ArrowInvalid, ...) name neither
        from nsa.data.shards import PREPARE_HINT, DataError
        from nsa.data.sources import is_url
        if is_url(str(path)):
            raise      # a hub read may fail for the network: Ray's error names the URL, and a retry may help
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise DataError(f"{path}: row group {unit.row_group} cannot be decoded ({type(exc).__name__}: {first}): "
                        f"the shard is corrupt; delete it and re-run {PREPARE_HINT} --out {Path(str(path)).parent} "
                        "--overwrite") from None
    READ_COUNTER["docs"] += len(col)
    READ_COUNTER["units"] += 1
    return col


def tokenize_texts(tokenizer: Any, col: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int64 [n], doc ends int64 [len(col)]): [doc, EOS, doc, EOS, ...] over the non-null texts."""
    valid = np.fromiter((isinstance(t, str) for t in col), dtype=bool, count=len(col))   # per doc
    stream = encode_stream(tokenizer, [t for t in col if isinstance(t, str)])
    return stream, doc_ends(stream, valid, tokenizer.eos_id)


def iter_local_units(files: Sequence[str | os.PathLike], units: Iterable[Unit],
                     tokenizer: Any) -> Iterator[tuple[Unit, np.ndarray, np.ndarray]]:
    """(unit, tokens, doc ends) read and tokenized in this process, one unit at a time."""
    for u in units:
        yield (u, *tokenize_texts(tokenizer, read_unit(files[u.shard], u)))


class RankEpoch:
    """Iterable of one rank's batches for one epoch (from a position), with `position()` after each.

    `source(units)` turns the units to read into (unit, tokens, doc ends) triples: in process or through
    Ray Data. Batches are int64 numpy [batch_size, seq_len+1]."""

    def __init__(self, files: Sequence[str | os.PathLike], units: list[Unit], seq_len: int, batch_size: int,
                 source: Any, start: DataPosition) -> None:
        from nsa.data.packing import SeekPacker
        self.files, self.units, self.epoch = list(files), units, start.epoch
        self.batches = start.batches_in_epoch
        self._source = source
        self._packer = SeekPacker(seq_len, batch_size, anchor=(start.shard, start.row_group, start.offset),
                                  carry=start.carry if start.carry.size else None)

    def __iter__(self) -> Iterator[np.ndarray]:
        for b in self._packer.drain():
            self.batches += 1
            yield b
        for u, tokens, ends in self._source(self.units):
            for b in self._packer.feed(u, tokens, ends):
                self.batches += 1
                yield b

    def position(self) -> DataPosition:
        shard, rg, offset, carry = self._packer.position()
        name = Path(str(self.files[shard])).name if shard >= 0 else ""
        return DataPosition(self.epoch, self.batches, shard, name, rg, offset, carry)


def rank_epoch(files: Sequence[str | os.PathLike], rg_rows: Sequence[Sequence[int]], *, epoch: int, rank: int,
               world: int, seq_len: int, batch_size: int, source: Any, shuffle_seed: int | None = None,
               start: DataPosition | None = None) -> RankEpoch:
    """One rank's epoch from `start` (None: its beginning); SeekError if `start` does not fit the data."""
    units = plan_units(rg_rows, epoch, rank, world, shuffle_seed)
    if start is None:
        start = DataPosition(epoch=epoch)
    elif start.epoch != epoch:
        raise SeekError(f"data position is in epoch {start.epoch}, asked for epoch {epoch}")
    return RankEpoch(files, seek_units(units, start, files), seq_len, batch_size, source, start)


class DeviceEpoch:
    """A RankEpoch's batches as int64 tensors [b, T+1] on `device` (pinned + async copy on CUDA), with
    the epoch's `position()`."""

    def __init__(self, epoch: RankEpoch, device: Any) -> None:
        self.epoch, self.device = epoch, device

    def __iter__(self) -> Iterator[Any]:
        import torch
        cuda = getattr(self.device, "type", str(self.device)) == "cuda"
        for b in self.epoch:
            t = torch.from_numpy(b)
            yield t.pin_memory().to(self.device, non_blocking=True) if cuda else t.to(self.device)

    def position(self) -> DataPosition:
        return self.epoch.position()
