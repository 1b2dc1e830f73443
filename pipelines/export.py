#!/usr/bin/env python
"""Export a trained checkpoint as a Hugging Face model directory (transformers' AutoModelForCausalLM).

    python pipelines/export.py --checkpoint runs/<run> --out export/<run>     # the run's latest checkpoint
    python pipelines/export.py --checkpoint runs/<run>/checkpoint_00000300 --out DIR --overwrite

DIR gets config.json, model.safetensors, generation_config.json and the byte tokenizer
(tokenizer_config.json). Load it with the library installed (pip install -e ".[hf]"):

    import nsa.hf                                   # registers model_type "nsa_tinylm" with the Auto classes
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(DIR), AutoTokenizer.from_pretrained(DIR)
    ids = tok("def main(", return_tensors="pt").input_ids
    print(tok.decode(model.generate(ids, max_new_tokens=64)[0]))

NSA and dense-twin checkpoints both export; the logits equal TinyLM's and greedy generate() equals
TinyLM.generate(cuda_graph=False). A non-empty --out is refused unless --overwrite; the export is written to
a temp dir beside --out and renamed into place, so a failed export changes nothing. Exit code 2 with one
error line for a missing/corrupt checkpoint, a non-empty --out or a missing transformers.
"""
from __future__ import annotations

import argparse

from nsa.launch.cli import UserError, main_entry


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="export.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--checkpoint", required=True, help="run dir (latest checkpoint), checkpoint dir or checkpoint.pt")
    p.add_argument("--out", required=True, help="directory to write (absent or empty, or see --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (after the new export is complete)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        from nsa.hf.export import ExportError, check_out_dir, export_checkpoint
    except ImportError as exc:
        raise UserError(f"{exc} (export needs transformers and safetensors)") from None
    try:
        check_out_dir(args.out, args.overwrite)     # before loading anything: a refused --out costs nothing
        f = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    except ExportError as exc:
        raise UserError(str(exc)) from None
    print(f"exported {f} -> {args.out} (load: import nsa.hf; AutoModelForCausalLM.from_pretrained({args.out!r}))")
    return 0


if __name__ == "__main__":
    main_entry(main)
