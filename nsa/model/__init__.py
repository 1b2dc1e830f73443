"""NSA models: LlamaBlockNSA and TinyLM (with cached generation)."""
from nsa.model.block import LlamaBlockNSA, RMSNorm, SwiGLU
from nsa.model.tinylm import TinyLM

__all__ = ["LlamaBlockNSA", "RMSNorm", "SwiGLU", "TinyLM"]
