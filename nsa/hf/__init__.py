"""Hugging Face transformers integration: `import nsa.hf` registers the NSA model with the Auto classes.

    import nsa.hf                                   # registers model_type "nsa_tinylm"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("export/")     # written by pipelines/export.py
    tok = AutoTokenizer.from_pretrained("export/")

Registration on import (rather than trust_remote_code files copied beside the weights) keeps one copy of
the model code, the installed library's. Needs the optional extra: pip install -e ".[hf]".
"""
from __future__ import annotations

try:
    import transformers
except ImportError as exc:   # the default install has no transformers
    raise ImportError("nsa.hf needs transformers and safetensors: pip install -e '.[hf]'") from exc

from nsa.hf.modeling import MODEL_TYPE, NSACache, NSAConfig, NSAForCausalLM
from nsa.hf.tokenization import NSAByteTokenizer

__all__ = ["MODEL_TYPE", "NSACache", "NSAConfig", "NSAForCausalLM", "NSAByteTokenizer", "register"]


def register() -> None:
    """Register the config, model and tokenizer with transformers' Auto classes (idempotent)."""
    transformers.AutoConfig.register(MODEL_TYPE, NSAConfig, exist_ok=True)
    transformers.AutoModelForCausalLM.register(NSAConfig, NSAForCausalLM, exist_ok=True)
    transformers.AutoTokenizer.register(NSAConfig, slow_tokenizer_class=NSAByteTokenizer, exist_ok=True)


register()
