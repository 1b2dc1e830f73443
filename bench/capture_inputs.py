#!/usr/bin/env python
"""Captured inputs: the NSA op's q/k/v/gates and block indices from a trained TinyLM on real text.

    python bench/capture_inputs.py                              # GPU defaults: prod_50k, seq 65536, 250 steps
    python bench/capture_inputs.py --load bench/captured/model  # reuse the model trained by an earlier run
    python bench/capture_inputs.py --load runs/<run>            # or a pipeline run / checkpoint directory
    python bench/capture_inputs.py --tiny                       # tiny CPU profile (crash test)

1. Model: trained here by bench_train.run_bare (the bare one-device loop: nsa.train's step, in the
   pipeline's step mode, over nsa.data's packed parquet iterator) for --steps steps of --seq tokens on the
   profile plus `section.key=value` overrides. Defaults put before yours: data.path=data/offline_python,
   train.seq_len=--seq, train.steps=--steps, train.warmup_steps=--steps/10 (the schedule fits the short
   run). Saved to <out>/model/ (model.pt: weights and config; recipe.json: how it was made).
2. Text: the data set's val split (held-out documents) packed as training packs them (same tokenizer, EOS
   between documents), its first max(--T) tokens; the model runs (eval, no grad, the profile's autocast)
   on the prefix of each --T length.
3. Capture: for each --layers layer, the op's eight inputs exactly as the layer passed them (a hook in
   NSAAttention: op_capture), its block_idx and output o, saved to <out>/T<T>_L<layer>.pt; <out>/meta.json
   holds the recipe, the op's hyperparameters, every file's shapes and dtypes and the locality table per T
   (block_idx of every layer, second half of the sequence; bench/common.py: locality).
   bench/bench_attention.py --inputs captured:<out> times the op on them.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import common
from common import CAPTURE_NAMES, ROOT

TINY = ["model.n_layers=2", "train.batch_size=1", "logging.mlflow=false", "logging.tensorboard=false",
        "runtime.num_workers=1"]


# ------------------------------------------------------------------------------------------ model
def build_config(profile: str, overrides: list[str], seq: int, steps: int):
    """(RunConfig, the full override list): this script's defaults first, then the caller's."""
    from nsa.config import resolve_config
    defaults = ["data.path=data/offline_python", f"train.seq_len={seq}", f"train.steps={steps}",
                f"train.warmup_steps={max(1, steps // 10)}", "train.eval_every=0", "train.save_every=0"]
    full = defaults + list(overrides)
    cfg, _ = resolve_config(profile, full)
    from nsa.launch import builder
    builder.validate_inputs(cfg)              # absolute data path; prepares the default offline corpus if absent
    return cfg, full


def train_model(cfg, steps: int, profile: str, overrides: list[str]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train with bench_train.run_bare; returns (model, recipe: how it was made)."""
    import bench_train
    r = bench_train.run_bare(cfg, steps, warmup=0)
    model = r.pop("model")
    losses = r["losses"]
    k = max(1, min(10, len(losses) // 2))
    recipe = {"how": "bench/capture_inputs.py -> bench_train.run_bare", "profile": os.path.relpath(profile, ROOT),
              "overrides": overrides, "steps": steps, "seq": cfg.train.seq_len, "batch_size": cfg.train.batch_size,
              "tokens": steps * r["tokens_per_step"], "final_loss": r["final_loss"],
              f"mean_loss_first_{k}": sum(losses[:k]) / k, f"mean_loss_last_{k}": sum(losses[-k:]) / k,
              "step_mode": r["step_mode"], "step_ms_p50": r["step_ms_p50"], "device": common.device_name(),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "config": cfg.to_dict()}
    return model, recipe


def save_model(model: torch.nn.Module, recipe: dict[str, Any], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "config": recipe["config"]}, directory / "model.pt")
    (directory / "recipe.json").write_text(json.dumps(recipe, indent=1))


def load_model(path: str, device: torch.device) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """(model, RunConfig, recipe) from a folder written by save_model, or a pipeline checkpoint / run dir."""
    from nsa.config import config_from_dict
    from nsa.model import TinyLM
    p = Path(path)
    if (p / "model.pt").is_file():
        state = torch.load(p / "model.pt", map_location="cpu", weights_only=True)
        recipe = json.loads((p / "recipe.json").read_text()) if (p / "recipe.json").is_file() else {}
        recipe = {**recipe, "loaded_from": str(p)}
    else:
        from nsa.train.checkpoint import load_checkpoint, resolve_checkpoint_file
        f = resolve_checkpoint_file(p)
        state = load_checkpoint(f)
        recipe = {"how": "pipeline checkpoint", "loaded_from": str(f), "steps": int(state["step"]),
                  "seq": state["config"]["train"]["seq_len"], "metrics": state.get("metrics", {}),
                  "config": state["config"]}
    cfg = config_from_dict(state["config"])
    model = TinyLM.from_config(cfg.model, cfg.nsa, compile_blocks=False)
    model.load_state_dict(state["model"], strict=True)
    return model.to(device), cfg, recipe


def with_overrides(cfg, overrides: list[str]):
    """cfg with `section.key=value` overrides applied (a loaded model's config)."""
    from nsa.config import config_from_dict, parse_overrides
    d = cfg.to_dict()
    for k, v in parse_overrides(overrides).items():
        section, key = k.split(".", 1)
        d[section][key] = v
    return config_from_dict(d)


# ------------------------------------------------------------------------------------------ text
def long_text(cfg, n_tokens: int) -> torch.Tensor:
    """[1, n_tokens] int64: the val split's documents packed as in training (cycled if shorter)."""
    from nsa.data.ray_data import iter_packed_batches
    from nsa.data.shards import find_val_shards
    files = find_val_shards(cfg.data.path)
    if not files:
        raise SystemExit(f"data.path={cfg.data.path}: no val-*.parquet (held-out split); prepare it with "
                         "pipelines/prepare_data.py (it writes one)")
    it = iter_packed_batches(files, n_tokens, cfg.data.tokenizer, 1, repeat=True, tiktoken_path=cfg.data.tiktoken_path)
    return torch.from_numpy(next(it)[:, :n_tokens]).long()


# ------------------------------------------------------------------------------------------ capture
def run_captures(model: torch.nn.Module, cfg, ids: torch.Tensor, Ts: list[int], layers: list[int],
                 out: Path | None) -> dict[str, Any]:
    """Run the model on ids[:, :T] for each T; capture the op's inputs/outputs of `layers` (saved to
    out/T<T>_L<layer>.pt when out is set, else kept in the result under "tensors") and every layer's
    locality table. Returns {"captures": [entry], "locality": {T: {"layers": {l: table}, "mean": table}},
    "tensors": {(T, l): dict} (out=None only)}."""
    from nsa.train import precision_from_config
    n = len(model.blocks)
    bad = [l for l in layers if not 0 <= l < n]
    if bad:
        raise SystemExit(f"--layers {bad}: the model has layers 0..{n - 1}")
    dev = next(model.parameters()).device
    prec = precision_from_config(cfg.runtime, dev)
    res: dict[str, Any] = {"captures": [], "locality": {}, "tensors": {}}
    attn = model.nsa_layers()
    block_idx: dict[int, torch.Tensor] = {}
    for T in Ts:
        def hook(layer, inputs, o, bi, T=T):
            i = attn.index(layer)
            block_idx[i] = bi
            if i not in layers:
                return
            d = {name: t.detach() for name, t in zip(CAPTURE_NAMES, inputs)}
            d.update(block_idx=bi.detach(), o=o.detach())
            entry = {"T": T, "layer": i, "file": common.capture_file(T, i), "op": layer._op_kwargs(),
                     "shapes": {k: list(v.shape) for k, v in d.items()},
                     "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in d.items()}}
            if out is not None:
                torch.save({k: v.cpu() for k, v in d.items()}, out / entry["file"])
            else:
                res["tensors"][(T, i)] = d
            res["captures"].append(entry)

        for a in attn:
            a.op_capture = hook
        try:
            with torch.no_grad(), prec.autocast():
                model.eval()(ids[:, :T].to(dev))
        finally:
            for a in attn:
                a.op_capture = None
        tables = {i: common.locality(block_idx[i]) for i in range(n)}
        res["locality"][T] = {"layers": tables, "mean": common.mean_locality(list(tables.values()))}
        keys = {i: common.key_locality(block_idx[i]) for i in range(n)}
        res.setdefault("key_locality", {})[T] = {"layers": keys, "mean": common.mean_locality(list(keys.values()))}
        block_idx.clear()
        print(f"T={T}: captured layers {layers}; locality (mean of {n} layers) "
              + " ".join(f"m={m}:{v:.3f}" for m, v in res["locality"][T]["mean"].items()), flush=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def write_meta(out: Path, recipe: dict[str, Any], cfg, Ts: list[int], layers: list[int], res: dict[str, Any]) -> None:
    """out/meta.json: how the model was made, the text, and every capture (what bench_attention reads)."""
    meta = {**common.metadata(), "recipe": {k: v for k, v in recipe.items() if k != "config"},
            "model_config": recipe.get("config"), "text": {"source": "val split", "data_path": str(cfg.data.path),
                                                           "tokenizer": cfg.data.tokenizer, "tokens": max(Ts)},
            "T": Ts, "layers": layers, "captures": res["captures"], "locality": res["locality"],
            "key_locality": res.get("key_locality", {})}
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))


def print_tables(loc: dict[int, Any], layers: list[int], keys: bool = False) -> None:
    rows = {}
    for T, t in loc.items():
        rows[f"T={T} mean of layers"] = t["mean"]
        rows.update({f"T={T} layer {l}": t["layers"][l] for l in layers})
    common.print_locality(rows, "captured inputs", keys=keys)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="profile (default prod_50k, or tiny_cpu with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="tiny CPU profile: --seq 256 --steps 4 --T 256 --layers 0 1")
    ap.add_argument("--seq", type=int, default=None, help="training sequence length (default 65536)")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 250)")
    ap.add_argument("--load", default=None,
                    help="skip training: a folder written by this script (<out>/model) or a pipeline run / "
                         "checkpoint directory")
    ap.add_argument("--T", type=int, nargs="+", default=None, help="capture lengths (default 8192 16384 32768 65536)")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="layers to capture (default first, middle, last: 0 5 11 for 12 layers)")
    ap.add_argument("--out", default=str(common.BENCH / "captured"), help="capture folder (git-ignored)")
    ap.add_argument("--copy-to", default=os.environ.get("OUT"),
                    help="also copy meta.json here as capture_meta.json (default $OUT)")
    ap.add_argument("overrides", nargs="*", metavar="section.key=value")
    a = ap.parse_args()
    profile = a.config or str(ROOT / "pipelines" / "configs" / ("tiny_cpu.yaml" if a.tiny else "prod_50k.yaml"))
    seq, steps = a.seq or (256 if a.tiny else 65536), a.steps or (4 if a.tiny else 250)
    Ts = a.T or ([256] if a.tiny else [8192, 16384, 32768, 65536])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.load:
        model, cfg, recipe = load_model(a.load, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        cfg = with_overrides(cfg, a.overrides)      # e.g. data.path: where the text comes from
        from nsa.launch import builder
        builder.validate_inputs(cfg)
    else:
        cfg, full = build_config(profile, (TINY if a.tiny else []) + a.overrides, seq, steps)
        model, recipe = train_model(cfg, steps, profile, full)
        save_model(model, recipe, out / "model")
        print(f"trained {steps} steps at seq {seq}: final loss {recipe['final_loss']:.3f}; saved {out / 'model'}",
              flush=True)
    n = len(model.blocks)
    layers = a.layers if a.layers is not None else sorted({0, n // 2 - 1 if n > 2 else n // 2, n - 1})
    ids = long_text(cfg, max(Ts))
    res = run_captures(model, cfg, ids, Ts, layers, out)
    write_meta(out, recipe, cfg, Ts, layers, res)
    print_tables(res["locality"], layers)
    print_tables(res["key_locality"], layers, keys=True)
    print(f"wrote {len(res['captures'])} captures and meta.json to {out}", flush=True)
    if a.copy_to:
        Path(a.copy_to).mkdir(parents=True, exist_ok=True)
        (Path(a.copy_to) / "capture_meta.json").write_text((out / "meta.json").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
