#!/usr/bin/env python
"""Generate text from a trained checkpoint (cached NSA decode via TinyLM.generate).

    python pipelines/generate.py --checkpoint runs/<run>                 # latest checkpoint of a run
    python pipelines/generate.py --checkpoint runs/<run>/checkpoint_00000300 --prompt "Hello NSA!" \\
        --max-new-tokens 128 --temperature 0.8 --top-k 50

The checkpoint is loaded with torch.load(weights_only=True); the model shape and tokenizer come from the
config stored in it. Exit code 2 with one error line for a missing/corrupt checkpoint or an empty prompt.
"""
from __future__ import annotations

import argparse
import time

import torch

from nsa.config import config_from_dict
from nsa.launch.cli import UserError, main_entry
from nsa.train.checkpoint import load_checkpoint, load_model_weights, resolve_checkpoint_file


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="generate.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="run dir, checkpoint dir or checkpoint.pt file")
    p.add_argument("--prompt", default="Hello NSA!", help="text to continue (default: %(default)r)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="weights/compute dtype")
    p.add_argument("--attention", choices=("nsa", "dense"), default=None,
                   help="model kind to build (default: the checkpoint's model.attention); the other kind is refused")
    p.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                   help="replay each decode step as one CUDA graph (auto: on CUDA with the Triton kernels)")
    return p


def main() -> int:
    args = _parser().parse_args()
    if args.max_new_tokens < 0 or args.temperature < 0 or (args.top_k is not None and args.top_k <= 0):
        raise UserError("--max-new-tokens and --temperature must be >= 0, --top-k > 0")
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
    model = TinyLM.from_config(cfg.model, cfg.nsa, grad_checkpointing=False)
    load_model_weights(model, state)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = model.to(device=args.device, dtype=dtype).eval()
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    x = torch.tensor([ids], dtype=torch.long, device=args.device)
    t0 = time.perf_counter()
    kw = dict(temperature=args.temperature, top_k=args.top_k, generator=gen)
    graphed = args.cuda_graph == "on" or (args.cuda_graph == "auto" and x.is_cuda)
    try:
        out = model.generate(x, args.max_new_tokens, cuda_graph=graphed, **kw)
    except ValueError as exc:
        if args.cuda_graph == "on":
            raise UserError(f"--cuda-graph on: {exc}") from exc
        print(f"cuda graph decode unavailable ({exc}); eager decode")
        graphed = False
        out = model.generate(x, args.max_new_tokens, **kw)
    dt = time.perf_counter() - t0
    new = out[0, len(ids):].tolist()
    print(f"checkpoint: {f} (step {state['step']}, {cfg.model.n_layers} layers x {cfg.model.dim}, "
          f"tokenizer {cfg.data.tokenizer})")
    print(f"generated {len(new)} tokens in {dt:.2f}s ({len(new) / max(dt, 1e-9):.1f} tok/s, cached decode"
          f"{', CUDA graph' if graphed else ''})")
    print("-" * 60)
    print(args.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    main_entry(main)
