"""Export a training checkpoint to a Hugging Face model directory (pipelines/export.py is the CLI).

The directory holds config.json (NSAConfig: the TinyLM's shape, model_type "nsa_tinylm"),
model.safetensors (the TinyLM's weights under `model.`), generation_config.json, and the byte tokenizer's
tokenizer_config.json / special_tokens_map.json (NSAByteTokenizer: no vocabulary file, the 256 bytes are
the vocabulary). Loading needs `import nsa.hf` first, which registers the classes with transformers' Auto
classes (no trust_remote_code, no code copied beside the weights: the installed library is the model code).

The directory is written complete or not at all: everything goes to a hidden temp dir beside --out that
is renamed into place at the end; an existing non-empty --out is replaced only with overwrite=True, and
only after the new export is complete.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from nsa.config import config_from_dict
from nsa.hf.modeling import NSAConfig, NSAForCausalLM
from nsa.hf.tokenization import NSAByteTokenizer
from nsa.model.tinylm import TinyLM
from nsa.train.checkpoint import load_checkpoint, load_model_weights, resolve_checkpoint_file


class ExportError(ValueError):
    """An export the user can fix by changing the arguments (one line)."""


def check_out_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """--out must be absent, an empty directory, or (with overwrite) a directory to replace."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {str(out)!r} is not empty: pass --overwrite to replace it, or choose a new directory")
    return out


def build_hf_model(state: dict) -> NSAForCausalLM:
    """The NSAForCausalLM of a loaded checkpoint state (its stored config gives the shape)."""
    cfg = config_from_dict(state["config"])
    if cfg.data.tokenizer != "byte":
        raise ExportError(f"the checkpoint was trained with tokenizer {cfg.data.tokenizer!r}; export writes the "
                          "byte tokenizer only (data.tokenizer=byte)")
    kwargs = TinyLM.config_kwargs(cfg.model, cfg.nsa)
    # the NSA kernel backend is the loading machine's choice, not the model's: "auto" runs anywhere
    hf_cfg = NSAConfig.from_tinylm_kwargs({**kwargs, "backend": "auto"}, nsa_step=int(state["step"]))
    model = NSAForCausalLM(hf_cfg)
    load_model_weights(model.model, state)          # strict; one line if the attention kind differs
    return model.eval()


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the HF directory for `checkpoint` (a run dir -> its latest checkpoint, a checkpoint dir or
    checkpoint.pt) to `out`; returns the checkpoint file exported. CheckpointError / ExportError: one line."""
    out = check_out_dir(out, overwrite)
    f = resolve_checkpoint_file(checkpoint)
    model = build_hf_model(load_checkpoint(f, map_location="cpu"))
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = 0   # NUL ends a document
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        NSAByteTokenizer().save_pretrained(tmp)
        if out.exists():
            os.replace(out, old)       # only now, with the new export complete
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            os.replace(old, out)       # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)
    return f
