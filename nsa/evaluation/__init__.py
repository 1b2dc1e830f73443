"""Evaluation and promotion of trained checkpoints (issue 48): held-out bits per byte and passkey
retrieval (core, report; pipelines/evaluate.py) and the MLflow model registry (registry; pipelines/promote.py)."""
