"""Native Sparse Attention: ops, layers, models, data, training and telemetry.

Top-level exports are the model pieces only; importing `nsa` pulls in torch but never Ray/MLflow.
"""
__version__ = "0.1.0"

from nsa.layers.attention import NSAAttention
from nsa.model.block import LlamaBlockNSA
from nsa.model.tinylm import TinyLM

__all__ = ["NSAAttention", "LlamaBlockNSA", "TinyLM", "__version__"]
