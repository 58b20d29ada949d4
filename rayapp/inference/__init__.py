"""Inference engines behind one client interface (``rayapp.inference.client``).

Importing this package loads neither torch nor sglang nor ray: the backends are imported on first
use (``make_backend("hf")``, or the lazy names ``HFBackend``, ``SGLangBackend``, ``ensure_tiny_model``).
"""

from __future__ import annotations

from typing import Any

from rayapp.inference.backends import make_backend
from rayapp.inference.client import (
    BACKENDS,
    DEFAULT_MAX_NEW_TOKENS,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    InferenceBackend,
    validate_request,
)

_LAZY = {
    "HFBackend": "rayapp.inference.hf",
    "SGLangBackend": "rayapp.inference.sglang",
    "ensure_tiny_model": "rayapp.inference.tiny_model",
    "load_tokenizer": "rayapp.inference.tiny_model",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS", "DEFAULT_MAX_NEW_TOKENS", "FinishReason", "GenerateOutput", "GenerateRequest", "HFBackend",
    "InferenceBackend", "SGLangBackend", "ensure_tiny_model", "load_tokenizer", "make_backend",
    "validate_request",
]
