"""The backends by name: ``make_backend("hf")`` (transformers on CPU) or ``make_backend("sglang")`` (GPU
clusters). Apart from ``client.py``, which the backends build on and so imports none of them; each is
imported on first use, so this module loads neither torch nor sglang.
"""

from __future__ import annotations

from typing import Any

from rayapp.inference.client import BACKENDS, Backend, InferenceBackend


def make_backend(kind: Backend | str, **kwargs: Any) -> InferenceBackend:
    """Build a backend by name: ``"hf"`` (transformers on CPU) or ``"sglang"`` (GPU clusters)."""
    if kind == "hf":
        from rayapp.inference.hf import HFBackend

        return HFBackend(**kwargs)
    if kind == "sglang":
        from rayapp.inference.sglang import SGLangBackend

        return SGLangBackend(**kwargs)
    raise ValueError(f"unknown inference backend {kind!r}: expected one of {', '.join(map(repr, BACKENDS))}")
