"""Native Sparse Attention: ops, layers, models, data, training and telemetry.

Top-level exports are the model pieces, loaded on first use: `import nsa.data` or `nsa.telemetry`
(Ray Data workers, the health-check CLI) then does not pay for importing torch and the model.
Importing `nsa` never pulls in Ray or MLflow.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "NSAAttention": "nsa.layers.attention",
    "LlamaBlockNSA": "nsa.model.block",
    "TinyLM": "nsa.model.tinylm",
}
__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from nsa.layers.attention import NSAAttention
    from nsa.model.block import LlamaBlockNSA
    from nsa.model.tinylm import TinyLM


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'nsa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))
