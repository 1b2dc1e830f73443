#!/usr/bin/env python
"""Generate text from a trained checkpoint (cached NSA decode via TinyLM.generate).

    python pipelines/generate.py --checkpoint runs/<run>                 # latest checkpoint of a run
    python pipelines/generate.py --checkpoint runs/<run>/checkpoint_00000300 --prompt "def main(" \\
        --max-new-tokens 128 --temperature 0.7 --top-k 20 --seed 1
    python pipelines/generate.py --checkpoint runs/<run> --greedy         # argmax, no penalty

Default decoding: sampling at temperature {T} among the {K} most likely tokens, with repetition penalty
{R} on every token already in the text (prompt included), seed {S} (the same output for the same checkpoint and prompt).
These are the usual settings for small models (llama.cpp's defaults): decoded greedily, a small model
soon loops on its likeliest byte. The tiny CPU profile's model (train.py's default run, trained on Python
source) continues "Hello NSA!" with " self.____..." or 64 spaces (after indentation it gives a space
p=0.55, the runner-up 0.08), which shows nothing of what it learned; sampled, it writes Python-like
lines ("self):", indented blocks, docstrings). A stronger penalty (1.3) makes a byte-level model pick rare
bytes. --greedy (or --temperature 0 --repetition-penalty 1) gives plain argmax decoding, the old default.

The checkpoint is loaded with torch.load(weights_only=True); the model shape and tokenizer come from the
config stored in it. Exit code 2 with one error line for a missing/corrupt checkpoint or an empty prompt.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

from nsa.config import config_from_dict, retired_env_warnings
from nsa.launch.cli import UserError, main_entry
from nsa.train.checkpoint import load_checkpoint, load_model_weights, resolve_checkpoint_file


TEMPERATURE, TOP_K, PENALTY, SEED = 0.8, 40, 1.1, 0   # the default decoding (module doc says why)
__doc__ = __doc__.format(T=TEMPERATURE, K=TOP_K, R=PENALTY, S=SEED)


def decoding(args: argparse.Namespace) -> dict[str, Any]:
    """TinyLM.generate's decoding keywords from the flags; UserError (one line naming the flag) if invalid."""
    given = [f for f, v in (("--temperature", args.temperature), ("--top-k", args.top_k),
                            ("--repetition-penalty", args.repetition_penalty)) if v is not None]
    if args.greedy:
        if given:
            raise UserError(f"--greedy: leave out {', '.join(given)} (greedy is argmax without penalty)")
        return dict(temperature=0.0, top_k=None, repetition_penalty=1.0)
    t = TEMPERATURE if args.temperature is None else args.temperature
    k = TOP_K if args.top_k is None else args.top_k
    r = PENALTY if args.repetition_penalty is None else args.repetition_penalty
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens={args.max_new_tokens}: must be >= 0")
    if not (math.isfinite(t) and t >= 0):
        raise UserError(f"--temperature={t}: must be >= 0 (0 = greedy)")
    if k < 0:
        raise UserError(f"--top-k={k}: must be >= 1, or 0 for all tokens")
    if not (math.isfinite(r) and r > 0):
        raise UserError(f"--repetition-penalty={r}: must be > 0 (1 = off, above 1 penalises repeats)")
    return dict(temperature=t, top_k=k or None, repetition_penalty=r)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir or checkpoint.pt file")
    p.add_argument("--prompt", default="Hello NSA!", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"softmax temperature; 0 = greedy (default: {TEMPERATURE})")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"sample among the k most likely tokens (default: {TOP_K}; 0 = all)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"> 1 lowers the logits of tokens already in the text; 1 = off (default: {PENALTY})")
    p.add_argument("--greedy", action="store_true",
                   help="argmax decoding without repetition penalty (instead of the three options above)")
    p.add_argument("--seed", type=int, default=SEED, help="sampling seed (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights/compute dtype")
    p.add_argument("--attention", choices=("nsa", "dense"), default=None,
                   help="model kind to build (default: the checkpoint's model.attention); the other kind is refused")
    p.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="replay each decode step as one CUDA graph (auto: on CUDA with the Triton kernels)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for w in retired_env_warnings():      # as train.py does (resolve_config): say it has no effect
        print(f"warning: {w}", file=sys.stderr, flush=True)
    dec = decoding(args)
    f = resolve_checkpoint_file(args.checkpoint)
    state = load_checkpoint(f, map_location="cpu")
    cfg = config_from_dict(state["config"])
    cfg.model.attention = args.attention or cfg.model.attention
    from nsa.data.tokenizers import get_tokenizer
    from nsa.model import TinyLM
    tok = get_tokenizer(cfg.data.tokenizer, tiktoken_path=cfg.data.tiktoken_path)
    ids = tok.encode(args.prompt)
    if not ids:
        raise UserError("--prompt encodes to no tokens: give at least one character")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    from nsa.train.limits import decode_budget
    try:   # before any allocation: a request that cannot fit is one line, not an 8 TB malloc
        decode_budget(cfg.model, len(ids), args.max_new_tokens, torch.device(args.device), dtype)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    model = TinyLM.from_config(cfg.model, cfg.nsa, grad_checkpointing=False)
    load_model_weights(model, state)
    model = model.to(device=args.device, dtype=dtype).eval()
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    t0 = time.perf_counter()
    kw = dict(dec, generator=gen)
    mode = {"on": True, "off": False, "auto": "auto"}[args.cuda_graph]
    try:   # "auto": TinyLM.generate graphs the decode wherever it applies (TinyLM.graph_blocker)
        out = model.generate(x, args.max_new_tokens, cuda_graph=mode, **kw)
    except ValueError as exc:
        raise UserError(f"--cuda-graph on: {exc}" if mode is True else str(exc)) from exc
    blocker = model.graph_blocker(x) if mode else "--cuda-graph off"
    graphed = blocker is None and args.max_new_tokens > 1
    dt = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    print(f"checkpoint: {f} (step {state['step']}, {cfg.model.n_layers} layers x {cfg.model.dim}, "
          f"tokenizer {cfg.data.tokenizer})")
    print(f"generated {len(new)} tokens in {dt:.2f}s ({len(new) / max(dt, 1e-9):.1f} tok/s, cached decode"
          f"{', CUDA graph' if graphed else ''})")
    if not graphed and x.is_cuda and blocker:
        print(f"eager decode: {blocker}")
    print("decoding: " + ("greedy (argmax)" if dec["temperature"] == 0 else
                          f"sampling, temperature {dec['temperature']}, top-k {dec['top_k'] or 'all'}, "
                          f"seed {args.seed}") +
          (f", repetition penalty {dec['repetition_penalty']}" if dec["repetition_penalty"] != 1 else ""))
    print("-" * 60)
    print(args.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    main_entry(main)
