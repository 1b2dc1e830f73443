"""Distributed pieces of NSA beyond data parallelism: context parallelism (nsa/dist/context_parallel.py)."""
from .context_parallel import (check_cp_length, chunk_len, chunk_starts, context_parallel, cp_nsa_attention,
                               cp_nsa_layer, gather_outputs, gather_sequence, local_positions, shard_sequence,
                               unshard_sequence)

__all__ = ["check_cp_length", "chunk_len", "chunk_starts", "context_parallel", "cp_nsa_attention", "cp_nsa_layer",
           "gather_outputs", "gather_sequence", "local_positions", "shard_sequence", "unshard_sequence"]
