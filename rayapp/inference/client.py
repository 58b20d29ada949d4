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
import math
from typing import Any, Protocol, runtime_checkable

import msgspec

from rayapp.types import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # when SamplingParams.max_new_tokens is None; sglang's default too
BACKENDS = ("hf", "sglang")


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One generation from token ids. An empty ``request_id`` gets a uuid4 hex in the backend;
    ``stop_token_ids`` stop in addition to the model's eos; ``ignore_eos`` generates through eos
    (fixed-length benchmarks and tests; sglang has the same switch)."""

    input_ids: list[int]
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""
    stop_token_ids: list[int] = []
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


def make_backend(kind: str, **kwargs: Any) -> InferenceBackend:
    """Build a backend by name: ``"hf"`` (transformers on CPU) or ``"sglang"`` (GPU clusters)."""
    if kind == "hf":
        from rayapp.inference.hf import HFBackend

        return HFBackend(**kwargs)
    if kind == "sglang":
        from rayapp.inference.sglang import SGLangBackend

        return SGLangBackend(**kwargs)
    raise ValueError(f"unknown inference backend {kind!r}: expected one of {', '.join(map(repr, BACKENDS))}")


def parse_request(obj: Any) -> GenerateRequest:
    """A GenerateRequest from outside data (a dict, JSON bytes), with one error naming the path."""
    try:
        if isinstance(obj, bytes | str):
            req = msgspec.json.decode(obj, type=GenerateRequest)
        else:
            req = msgspec.convert(obj, GenerateRequest)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid generate request: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"invalid generate request: not JSON ({e})") from None
    validate_request(req)
    return req


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def validate_request(req: GenerateRequest, vocab_size: int | None = None) -> None:
    """Raise one ValueError naming the first bad field. Struct constructors do not type-check, so
    types are checked here too. ``vocab_size`` (known to a backend) bounds the token ids."""
    rid = f" {req.request_id!r}" if req.request_id else ""

    def bad(field: str, expected: str, got: Any) -> ValueError:
        return ValueError(f"invalid generate request{rid}: {field} must be {expected}, got {got!r}")

    if not isinstance(req.input_ids, list) or not req.input_ids:
        raise bad("input_ids", "a non-empty list of token ids", req.input_ids)
    limit = f" < {vocab_size}" if vocab_size is not None else ""
    for field, ids in (("input_ids", req.input_ids), ("stop_token_ids", req.stop_token_ids)):
        if not isinstance(ids, list):
            raise bad(field, "a list of token ids", ids)
        for i, t in enumerate(ids):
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise bad(f"{field}[{i}]", f"an int >= 0{limit} (the vocabulary size)" if limit else "an int >= 0", t)
    if not isinstance(req.request_id, str):
        raise bad("request_id", "a string", req.request_id)
    if not isinstance(req.ignore_eos, bool):
        raise bad("ignore_eos", "a bool", req.ignore_eos)

    s = req.sampling
    if not isinstance(s, SamplingParams):
        raise bad("sampling", "a SamplingParams", s)
    if s.temperature is not None and not (_is_number(s.temperature) and math.isfinite(s.temperature)
                                          and s.temperature >= 0):
        raise bad("sampling.temperature", "a finite number >= 0 (0 = greedy)", s.temperature)
    if s.top_p is not None and not (_is_number(s.top_p) and 0 < s.top_p <= 1):
        raise bad("sampling.top_p", "a number in (0, 1]", s.top_p)
    if s.top_k is not None and not (_is_int(s.top_k) and (s.top_k == -1 or s.top_k >= 1)):
        raise bad("sampling.top_k", "-1 (off) or an int >= 1", s.top_k)
    if s.max_new_tokens is not None and not (_is_int(s.max_new_tokens) and s.max_new_tokens >= 1):
        raise bad("sampling.max_new_tokens", "an int >= 1", s.max_new_tokens)
    if s.stop is not None and not (isinstance(s.stop, list) and all(isinstance(x, str) and x for x in s.stop)):
        raise bad("sampling.stop", "a list of non-empty strings", s.stop)
    if s.seed is not None and not (_is_int(s.seed) and 0 <= s.seed < 2**63):
        raise bad("sampling.seed", "an int in [0, 2**63)", s.seed)
