"""Native Sparse Attention: ops, layers, models, data, training and telemetry."""
__version__ = "0.1.0"
