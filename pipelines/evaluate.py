#!/usr/bin/env python
"""Evaluate a trained checkpoint (NSA or dense twin): held-out bits per byte by context length, passkey retrieval.

    python pipelines/evaluate.py --checkpoint runs/<run>                       # latest checkpoint, defaults
    python pipelines/evaluate.py --checkpoint runs/<run>/checkpoint_00000300 --lengths 256 1024 4096 \\
        --passkey-lengths 1024 4096 16384 --depths 0 0.5 1 --trials 8 --device cuda --dtype bf16

Bits per byte: the run's val split (data.val_path, or the val-*.parquet beside data.path; --data picks
another) cut into windows of each --lengths value, every position scored, at most --max-tokens tokens per
length. The first --lengths value (default: the run's train.seq_len) is the headline ``val_bpb`` that
promote.py compares. Passkey: a random key planted at each --depths fraction of filler text, asked for at
the end; a trial counts when greedy decoding would give the key exactly (nsa/evaluation/core.py).

Writes <run dir>/eval/eval_step_<step>.json and passkey_step_<step>.png (an existing evaluation of the same
step is refused unless --overwrite, which replaces each file atomically), prints the tables, and logs
eval/* metrics at the checkpoint's step plus both files to the run's MLflow run (mlflow_run.json; else a
new run in the run's experiment; --no-mlflow skips). Exit code 2 with one line for bad input.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nsa.launch.cli import UserError, main_entry

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
MAX_TOKENS = 65536


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="evaluate.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="run dir (its latest checkpoint), checkpoint dir or .pt file")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="context lengths for bits per byte, the first one the headline (default: train.seq_len x 1 2 4)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="scored val tokens per length, at least one window (default: %(default)s)")
    p.add_argument("--passkey-lengths", type=int, nargs="+", default=None,
                   help="passkey prompt lengths in tokens (default: the --lengths values, raised to the prompt's minimum)")
    p.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS),
                   help="key depths in [0, 1]: 0 right after the instructions, 1 just before the question "
                        "(default: %(default)s)")
    p.add_argument("--trials", type=int, default=4, help="keys per (length, depth) (default: %(default)s)")
    p.add_argument("--digits", type=int, default=5, help="digits of the key (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="key seed: the same keys for every model (default: %(default)s)")
    p.add_argument("--no-passkey", action="store_true", help="bits per byte only")
    p.add_argument("--batch-size", type=int, default=1, help="windows / trials per forward (default: %(default)s)")
    p.add_argument("--data", default=None,
                   help="val shard, prepared data dir or parquet URL (default: the run's data.val_path / val split)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights/compute dtype")
    p.add_argument("--out", default=None, help="folder for the JSON and plot (default: <run dir>/eval)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier evaluation of the same step")
    p.add_argument("--mlflow-uri", default=None, help="tracking URI (default: the run's, else <runs root>/mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true", help="write the JSON and plot only")
    return p


def check_args(args: argparse.Namespace, seq_len: int, overhead: int) -> None:
    """Fill defaults that depend on the run, then one UserError line naming the first bad flag."""
    if args.lengths is None:
        args.lengths = [seq_len, 2 * seq_len, 4 * seq_len]
    if args.passkey_lengths is None:
        args.passkey_lengths = sorted({max(n, overhead + 32) for n in args.lengths})
    for flag, vals in (("--lengths", args.lengths), ("--passkey-lengths", args.passkey_lengths)):
        bad = [n for n in vals if n < 1]
        if bad:
            raise UserError(f"{flag}={bad[0]}: lengths must be >= 1 token")
    short = [n for n in args.passkey_lengths if n < overhead]
    if short and not args.no_passkey:
        raise UserError(f"--passkey-lengths={short[0]} is shorter than the passkey prompt ({overhead} tokens "
                        f"with this tokenizer): use lengths >= {overhead}, or --no-passkey")
    bad_d = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad_d:
        raise UserError(f"--depths={bad_d[0]}: depths are fractions in [0, 1]")
    for flag, val, lo in (("--max-tokens", args.max_tokens, 1), ("--trials", args.trials, 1),
                          ("--digits", args.digits, 1), ("--batch-size", args.batch_size, 1)):
        if val < lo:
            raise UserError(f"{flag}={val}: must be >= {lo}")
    if args.digits > 18:
        raise UserError(f"--digits={args.digits}: use at most 18 digits")
    args.lengths = list(dict.fromkeys(args.lengths))       # keep the order: the first is the headline
    args.passkey_lengths = sorted(set(args.passkey_lengths))
    args.depths = sorted(set(args.depths))


def val_files(cfg: Any, data: str | None) -> list[str]:
    from nsa.data.shards import resolve_val_files
    try:
        files = resolve_val_files(cfg.data.path, data or cfg.data.val_path)
    except (OSError, ValueError) as exc:
        raise UserError(f"--data: {str(exc).splitlines()[0]}") from None
    if not files:
        raise UserError(f"--data: the run's data ({cfg.data.path}) has no val split (val-*.parquet): pass --data "
                        "<val shard or prepared data dir> (held-out text, never trained on)")
    return files


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from nsa.config import config_from_dict
    from nsa.data.tokenizers import get_tokenizer
    from nsa.evaluation import core, report
    from nsa.train.checkpoint import CheckpointError, checkpoint_kind, load_checkpoint, resolve_checkpoint_file

    try:
        f = resolve_checkpoint_file(args.checkpoint)
        state = load_checkpoint(f, map_location="cpu")
    except CheckpointError as exc:
        raise UserError(f"--checkpoint: {exc}") from None
    step, kind = int(state["step"]), checkpoint_kind(state)
    cfg = config_from_dict(state["config"])
    tok = get_tokenizer(cfg.data.tokenizer, tiktoken_path=cfg.data.tiktoken_path)
    check_args(args, cfg.train.seq_len, core.passkey_overhead(tok, args.digits))
    run_dir = report.run_dir_of(f)
    out_dir = Path(args.out) if args.out else run_dir / report.EVAL_DIR
    json_path, png_path = report.eval_paths(out_dir, step)
    report.check_writable(json_path, args.overwrite)           # before any work
    files = val_files(cfg, args.data)
    device, dtype = torch.device(args.device), {"fp32": torch.float32, "bf16": torch.bfloat16,
                                                 "fp16": torch.float16}[args.dtype]
    try:   # before any allocation: a length that cannot fit is one line, not an out-of-memory crash
        for flag, lengths in (("--lengths", args.lengths), ("--passkey-lengths", [] if args.no_passkey
                                                                                else args.passkey_lengths)):
            for n in lengths:
                core.forward_budget(cfg.model, args.batch_size, n, device, dtype, flag=flag)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    model = core.build_model(state["config"], state["model"], device, dtype)
    del state
    print(f"checkpoint: {f} (step {step}, model.attention={kind}, {cfg.model.n_layers} layers x {cfg.model.dim}, "
          f"tokenizer {cfg.data.tokenizer}, {args.device} {args.dtype})", flush=True)

    t0 = time.perf_counter()
    need = max(args.lengths) + 1 + max(args.max_tokens, max(args.lengths)) + len(args.lengths)
    stream = core.val_stream(files, tok, need)
    bpb = []
    for n in args.lengths:
        try:
            bpb.append(core.bits_per_byte(model, stream, tok, n, max_tokens=args.max_tokens,
                                          batch_size=args.batch_size))
        except ValueError as exc:
            raise UserError(str(exc)) from None
        r = bpb[-1]
        print(f"val bits/byte @ {n:>6} tokens: {r['bpb']:.4f}  ({r['windows']} windows, {r['tokens']} tokens)",
              flush=True)
    results: dict[str, Any] = {
        "format": report.FORMAT, "checkpoint": str(f), "step": step, "run_dir": str(run_dir),
        "attention": kind, "tokenizer": cfg.data.tokenizer, "device": args.device, "dtype": args.dtype,
        "created": time.time(), "default_length": args.lengths[0], "val_bpb": bpb[0]["bpb"], "bpb": bpb,
        "val": {"files": files, "fingerprint": core.val_fingerprint(files), "max_tokens": args.max_tokens},
    }
    written = [json_path]
    if not args.no_passkey:
        cells = [core.passkey_cell(model, tok, n, d, trials=args.trials, seed=args.seed, digits=args.digits,
                                   batch_size=args.batch_size)
                 for n in args.passkey_lengths for d in args.depths]
        by_len = {str(n): sum(c["accuracy"] for c in cells if c["length"] == n) / len(args.depths)
                  for n in args.passkey_lengths}
        table = core.passkey_table(cells)
        results["passkey"] = {"digits": args.digits, "trials": args.trials, "seed": args.seed,
                              "lengths": args.passkey_lengths, "depths": args.depths, "cells": cells,
                              "accuracy_by_length": by_len, "table": table, "plot": png_path.name}
        print(f"passkey accuracy ({args.trials} keys of {args.digits} digits per cell):\n{table}", flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = png_path.with_name(f".{png_path.name}.{os.getpid()}.tmp.png")
        try:   # rendered beside the target, renamed over it: an old plot is never half-replaced
            core.plot_passkey(cells, tmp, title=f"{run_dir.name} step {step} ({kind}): passkey accuracy")
            os.replace(tmp, png_path)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(png_path)
    results["seconds"] = round(time.perf_counter() - t0, 2)

    mlrun = None
    if not args.no_mlflow:
        uri, run_id, experiment = report.mlflow_target(run_dir, cfg, args.mlflow_uri)
        try:
            mlrun = report.EvalRun(uri, experiment, run_id, f"eval-{run_dir.name}-step{step}",
                                   {"run_dir": str(run_dir), "nsa.eval_of": str(f)})
            results["mlflow"] = {"tracking_uri": uri, "run_id": mlrun.run_id, "experiment": experiment,
                                 "new_run": mlrun.new}
        except Exception as exc:    # the evaluation stands without MLflow: say so, keep the files
            print(f"warning: MLflow logging skipped ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                  file=sys.stderr)
    report.write_eval_json(json_path, results)
    if mlrun is not None:
        try:
            mlrun.log(report.eval_metrics(results), step, written, f"eval/step_{step:08d}")
            mlrun.close("FINISHED")
            print(f"MLflow: eval/* metrics at step {step} in run {mlrun.run_id} ({results['mlflow']['tracking_uri']})"
                  + (f"; {mlrun.note}" if mlrun.note else ""))
        except Exception as exc:
            mlrun.close("FAILED")
            print(f"warning: MLflow logging failed ({type(exc).__name__}: {str(exc).splitlines()[0]})",
                  file=sys.stderr)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    main_entry(main)
