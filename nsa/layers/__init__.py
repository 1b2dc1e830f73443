"""NSA layers: attention (projections, RoPE, compression, gates), KV cache; the dense twin."""
from nsa.layers.attention import NSAAttention, validate_nsa_args
from nsa.layers.cache import NSAKVCache
from nsa.layers.compression import BlockCompressor, num_compressed
from nsa.layers.dense import DenseAttention, DenseKVCache
from nsa.layers.rope import RotaryEmbedding, apply_rope

__all__ = ["NSAAttention", "NSAKVCache", "BlockCompressor", "RotaryEmbedding", "apply_rope",
           "num_compressed", "validate_nsa_args", "DenseAttention", "DenseKVCache"]
