#!/usr/bin/env python
"""Prepare training data: documents -> parquet shards (FineWeb-Edu columns) + val shard + manifest.

Examples:
    python pipelines/prepare_data.py                                  # offline Python corpus, ~30 MB
    python pipelines/prepare_data.py --source jsonl --input /data/fineweb.jsonl --out data/fwe
    python pipelines/prepare_data.py --source txt --input notes/ --txt-split paragraph
    python pipelines/prepare_data.py --source hub --max-bytes 2e9 --out data/fineweb_edu  # online
    ray job submit --working-dir . -- python pipelines/prepare_data.py --source hub --max-bytes 2GB \
        --storage-root /mnt/shared --out data/fineweb_edu        # as a Ray job, onto shared storage

The offline corpus (--source local) is the Python installation's own source files and documentation:
code more than prose. Its default --out, data/offline_python, is data.path's default, which train.py
builds itself when missing; the hub's default --out is data/fineweb_edu (prod_50k's data.path).
Running again with the same inputs into a prepared --out does nothing and says so; other inputs into a
non-empty --out are refused unless --overwrite is given.

Training then points `data.path` at the --out directory (checked by nsa.data.shards.check_data_path).
A relative --out resolves against --storage-root (default: $NSA_STORAGE_ROOT, which the cluster nodes set
to /mnt/shared), else the working directory; an --out inside Ray's working-dir copy of a job is refused,
as for training runs (nsa/launch/storage.py): `--out data/fineweb_edu` then lands where
`data.path=data/fineweb_edu` with the same storage root reads it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from nsa.config import env_storage_root
from nsa.data.shards import MANIFEST, read_manifest, write_shards
from nsa.data.sources import (DEFAULT_OUT, OFFLINE_MAX_BYTES, OFFLINE_VAL_DOCS, SHARD_BYTES, SOURCES,
                              iter_source, prepare_inputs)
from nsa.data.tokenizers import get_tokenizer
from nsa.launch.cli import UserError
from nsa.launch.owner import own
from nsa.launch.storage import prepare_out

DEFAULT_MAX_BYTES = OFFLINE_MAX_BYTES   # the same as train.py's auto-prepare, so that a re-run is a no-op
DEFAULT_VAL_DOCS = OFFLINE_VAL_DOCS


def _size(text: str) -> int:
    """Accept 30000000, 3e7, 30MB, 30M, 2GB."""
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 30000000, 3e7, 30MB)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--source", choices=SOURCES, default="local",
                   help="local: the Python installation's own source and text files (offline); jsonl/txt: "
                        "--input files; hub: HuggingFaceFW/fineweb-edu streaming (needs network)")
    p.add_argument("--input", default=None,
                   help="file or directory for jsonl/txt (for local: another root folder)")
    p.add_argument("--out", default=None,
                   help="output directory (default by --source: " +
                        ", ".join(f"{k}: {v}" for k, v in DEFAULT_OUT.items()) +
                        "); relative: under --storage-root when given, else the working directory")
    p.add_argument("--storage-root", default=env_storage_root(),
                   help="shared storage that a relative --out resolves against (runtime.storage_root of the "
                        "training runs; default $NSA_STORAGE_ROOT)")
    p.add_argument("--max-docs", type=int, default=None, help="stop after this many documents")
    p.add_argument("--max-bytes", type=_size, default=DEFAULT_MAX_BYTES,
                   help="stop before exceeding this much UTF-8 text (all splits)")
    p.add_argument("--docs-per-shard", type=int, default=None,
                   help="documents per train shard (default: close shards at --shard-bytes)")
    p.add_argument("--shard-bytes", type=_size, default=SHARD_BYTES,
                   help="target text bytes per shard when --docs-per-shard is not given")
    p.add_argument("--val-docs", type=int, default=None,
                   help=f"held-out documents, the first ones of the stream (default "
                        f"{DEFAULT_VAL_DOCS} unless --val-fraction is given; 0 = no val shard)")
    p.add_argument("--val-fraction", type=float, default=None,
                   help="instead: hold out documents whose id hashes below this fraction "
                        "(capped by --val-docs when both are given)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the shards/manifest of a non-empty --out (also when prepared with "
                        "the same inputs, which is otherwise a no-op)")
    p.add_argument("--txt-split", choices=("file", "paragraph"), default="file",
                   help="txt source: one document per file or per blank-line-separated block")
    p.add_argument("--hub-name", default="sample-10BT", help="FineWeb-Edu config for --source hub")
    p.add_argument("--hub-timeout", type=float, default=20.0,
                   help="seconds to wait for the hub before failing (suggests --source local)")
    p.add_argument("--count-tokenizer", default="byte", choices=("byte", "gpt2"),
                   help="tokenizer whose token counts go into the manifest")
    p.add_argument("--tiktoken-path", default=None,
                   help="local gpt2.tiktoken file or cache dir (for --count-tokenizer gpt2)")
    p.add_argument("--seed", type=int, default=0, help="order of the local corpus")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _progress(total_bytes: int | None, enabled: bool) -> tuple[Callable[[int, int], None],
                                                                Callable[[], None]]:
    """(update(docs, bytes), close()) with tqdm when installed, else a throttled stderr line."""
    if not enabled:
        return (lambda d, b: None), (lambda: None)
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="documents -> shards",
                   file=sys.stderr, mininterval=0.5)
        state = {"bytes": 0}

        def update(docs: int, nbytes: int) -> None:
            bar.update(nbytes - state["bytes"])
            state["bytes"] = nbytes
            bar.set_postfix(docs=docs, refresh=False)

        return update, bar.close
    last = [0.0]

    def update_plain(docs: int, nbytes: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            print(f"\r{docs} docs, {nbytes / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)

    return update_plain, lambda: print(file=sys.stderr)


def summarize(manifest: dict, out: str, seconds: float) -> str:
    t = manifest["totals"]
    lines = [f"wrote {out} in {seconds:.1f}s (source: {manifest['source']}, token counts: "
             f"{manifest['token_counter']})",
             f"  train: {t['train_shards']} shards, {t['train_docs']} docs, {t['train_tokens']:,} tokens",
             f"  val:   {len(manifest['val'])} shards, {t['val_docs']} docs, {t['val_tokens']:,} tokens"]
    for e in manifest["train"] + manifest["val"]:
        lines.append(f"    {e['path']:<32} {e['docs']:>6} docs {e['tokens']:>12,} tokens "
                     f"{e['file_bytes'] / 1e6:7.2f} MB  sha256 {e['sha256'][:12]}")
    return "\n".join(lines)


def _differences(recorded: Any, inputs: dict[str, Any]) -> str:
    if not isinstance(recorded, dict):
        return "its manifest records no inputs (prepared by an older version or by hand)"
    keys = [k for k in dict.fromkeys([*recorded, *inputs]) if recorded.get(k) != inputs.get(k)]
    return ", ".join(f"{k}: {recorded.get(k)!r} there, {inputs.get(k)!r} now" for k in keys)


def already_prepared(out: str, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of `out` when it was prepared from `inputs` and all its shards are there; None when
    `out` is missing or empty. FileExistsError (one line naming --out and --overwrite) otherwise."""
    path = Path(out)
    if not path.is_dir() or not any(not p.name.startswith(".tmp-") for p in path.iterdir()):
        return None
    fix = "pass --overwrite to replace it, or choose another --out"
    try:
        manifest = read_manifest(path)
    except ValueError as exc:
        raise FileExistsError(f"--out {out}: {exc}") from None
    if manifest is None:
        raise FileExistsError(f"--out {out} is not empty and has no {MANIFEST}: not prepared data; {fix}")
    diff = _differences(manifest.get("inputs"), inputs)
    if diff:
        raise FileExistsError(f"--out {out} holds data prepared with other inputs ({diff}); {fix}")
    missing = [e["path"] for e in manifest["train"] + manifest.get("val", []) if not (path / e["path"]).is_file()]
    if missing:
        raise FileExistsError(f"--out {out}: {len(missing)} shard(s) of its manifest are missing (first: "
                              f"{missing[0]}); pass --overwrite to prepare it again")
    return manifest


def _check_args(args: argparse.Namespace) -> None:
    """Counts and sizes that cannot work, as one UserError naming the flag (exit 2), before anything is read."""
    for flag, value, low in (("--max-docs", args.max_docs, 1), ("--val-docs", args.val_docs, 0),
                             ("--docs-per-shard", args.docs_per_shard, 1), ("--shard-bytes", args.shard_bytes, 1),
                             ("--max-bytes", args.max_bytes, 1)):
        if value is not None and value < low:
            raise UserError(f"{flag}={value} must be >= {low}")


def _counter(args: argparse.Namespace) -> Any:
    if args.count_tokenizer == "byte":
        return None
    try:
        return get_tokenizer(args.count_tokenizer, tiktoken_path=args.tiktoken_path)
    except (ValueError, OSError, ImportError) as exc:    # offline without the BPE file: one line, the flags
        raise UserError(f"--count-tokenizer {args.count_tokenizer} (--tiktoken-path {args.tiktoken_path}): "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; "
                        "or use --count-tokenizer byte") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    val_docs = args.val_docs
    if val_docs is None and args.val_fraction is None:
        val_docs = DEFAULT_VAL_DOCS
    try:
        _check_args(args)
        counter = _counter(args)
    except UserError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        args.out = DEFAULT_OUT[args.source]
    elif args.source == "local" and "fineweb" in Path(args.out).name.lower():
        # an explicit path is kept; the note keeps the Python text from passing for FineWeb-Edu unnoticed
        print(f"note: --out {args.out} gets the offline Python corpus (--source local), not FineWeb-Edu; "
              f"its default folder is {DEFAULT_OUT['local']}", file=sys.stderr)
    inputs = prepare_inputs(args.source, args.input, max_docs=args.max_docs, max_bytes=args.max_bytes,
                            docs_per_shard=args.docs_per_shard, shard_bytes=args.shard_bytes,
                            val_docs=val_docs, val_fraction=args.val_fraction, txt_split=args.txt_split,
                            hub_name=args.hub_name, seed=args.seed, count_tokenizer=args.count_tokenizer)
    try:
        out = str(prepare_out(args.out, args.storage_root, root_field="--storage-root"))
        # one preparation per --out at a time: two at once would both commit, one manifest listing half the
        # shards; held from the "already there?" check to the manifest's rename
        lock = own(out, "--out", "another prepare_data.py (or train.py's data.auto_prepare) is writing it: wait "
                   "for it to end, then run this again (it does nothing if that one prepared the same inputs)")
    except (UserError, FileExistsError) as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _prepare(args, out, inputs, val_docs, counter)
    finally:
        lock.release()


def _prepare(args: argparse.Namespace, out: str, inputs: dict[str, Any], val_docs: int | None, counter: Any) -> int:
    """Write the shards into ``out`` (locked by the caller), or do nothing when they are already there."""
    try:
        if not args.overwrite and (done := already_prepared(out, inputs)) is not None:
            t = done["totals"]
            print(f"data already there: {out} was prepared from the same inputs ({done.get('created_utc', '?')}; "
                  f"{t['train_shards']} train shards, {t['train_tokens']:,} tokens); nothing to do "
                  f"(--overwrite prepares it again)")
            print(json.dumps({"out": out, "unchanged": True, **t}))
            return 0
    except FileExistsError as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        docs = iter_source(args.source, args.input, max_docs=args.max_docs,
                           max_bytes=args.max_bytes, txt_split=args.txt_split,
                           hub_name=args.hub_name, hub_timeout_s=args.hub_timeout, seed=args.seed)
        update, close = _progress(args.max_bytes, not args.no_progress)
        try:
            manifest = write_shards(docs, out, docs_per_shard=args.docs_per_shard,
                                    shard_bytes=args.shard_bytes, val_docs=val_docs,
                                    val_fraction=args.val_fraction, overwrite=args.overwrite,
                                    tokenizer=counter, progress=update, inputs=inputs,
                                    source=f"{args.source}:{args.input or args.hub_name}"
                                    if args.source != "local" else "local:python-stdlib")
        finally:
            close()
    except (FileNotFoundError, FileExistsError, ValueError, ConnectionError, ImportError) as exc:
        print(f"prepare_data: error: {exc}", file=sys.stderr)
        return 2
    print(summarize(manifest, out, time.monotonic() - t0))
    print(json.dumps({"out": out, **manifest["totals"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
