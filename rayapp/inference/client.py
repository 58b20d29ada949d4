"""The one interface agents use to talk to an inference engine, whatever the backend.

An agent sends token ids with sampling params and stop conditions and gets back the output token
ids, the log-prob of each chosen token, and why generation ended. Invariants every backend keeps:

- ``len(output.logprobs) == len(output.output_ids)`` and every log-prob is ``<= 0``;
- ``finish_reason`` is STOP (eos, a stop token or a stop string), LENGTH (``max_new_tokens`` or the
  model's context is full) or ABORT (``abort()`` was called; the tokens made so far are returned);
- ``output_ids`` include the token that ended the generation (eos or stop token): the trainer needs
  its log-prob; ``text`` is the decoded reply without special tokens, cut before a matched stop string;
- a bad request raises one ``ValueError`` naming the field, before anything runs.

This module imports neither torch nor ray: the scheduler core and the Ray shell can both use it.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Protocol, get_args, runtime_checkable

import msgspec

from rayapp.core.convert import InputError, check
from rayapp.types import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # when SamplingParams.max_new_tokens is None; sglang's default too
Backend = Literal["hf", "sglang"]
BACKENDS: tuple[str, ...] = get_args(Backend)
TokenId = Annotated[int, msgspec.Meta(ge=0)]


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One generation from token ids. An empty ``request_id`` gets a uuid4 hex in the backend;
    ``stop_token_ids`` stop in addition to the model's eos; ``ignore_eos`` generates through eos
    (fixed-length benchmarks and tests; sglang has the same switch)."""

    input_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False


class GenerateOutput(msgspec.Struct):
    """What one generation produced. ``logprobs[i]`` is the log-prob of ``output_ids[i]``;
    ``weight_version`` names the weights that produced it (see ``update_weights_from_disk``)."""

    request_id: str
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str = ""
    prompt_len: int = 0
    engine: str = ""
    weight_version: str = ""

    def __post_init__(self):
        if len(self.logprobs) != len(self.output_ids):
            raise ValueError(f"request {self.request_id!r}: {len(self.output_ids)} output ids but "
                             f"{len(self.logprobs)} log-probs")


@runtime_checkable
class InferenceBackend(Protocol):
    """What a Ray inference deployment holds and forwards calls to."""

    async def generate(self, req: GenerateRequest) -> GenerateOutput: ...

    async def abort(self, request_id: str | None = None) -> int:
        """Abort one request (or every request in flight when None); return how many were aborted."""
        ...

    async def health(self) -> dict[str, Any]:
        """``{"ok": bool, "backend": name, "model": path, "in_flight": n, ...}``."""
        ...

    async def update_weights_from_disk(self, path: str) -> dict[str, Any]:
        """Load new weights between requests; ``{"ok": True, "path": path, "version": n}``."""
        ...

    def info(self) -> dict[str, Any]:
        """model_path, tokenizer_path, eos/pad ids, whether a chat template is present, max_context_len."""
        ...

    def shutdown(self) -> None: ...


def make_backend(kind: Backend | str, **kwargs: Any) -> InferenceBackend:
    """Build a backend by name: ``"hf"`` (transformers on CPU) or ``"sglang"`` (GPU clusters)."""
    if kind == "hf":
        from rayapp.inference.hf import HFBackend

        return HFBackend(**kwargs)
    if kind == "sglang":
        from rayapp.inference.sglang import SGLangBackend

        return SGLangBackend(**kwargs)
    raise ValueError(f"unknown inference backend {kind!r}: expected one of {', '.join(map(repr, BACKENDS))}")


def validate_request(req: GenerateRequest, vocab_size: int | None = None) -> GenerateRequest:
    """``req`` put through its type's bounds (one ``InputError`` naming the first bad field: a Struct
    built in code was never checked), and its token ids through ``vocab_size`` when a backend knows it."""
    source = f"generate request {req.request_id!r}" if req.request_id else "generate request"
    req = check(req, source)
    for field in ("input_ids", "stop_token_ids") if vocab_size is not None else ():
        ids = getattr(req, field)
        i = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
        if i is not None:
            raise InputError(source, f"$.{field}[{i}]", f"expected int < {vocab_size} (the vocabulary size), "
                                                         f"got {ids[i]}")
    return req
