"""The ``sglang`` backend for GPU clusters: an ``sglang.Engine`` behind the InferenceBackend interface.

``sglang`` is an optional extra (``pip install rayapp[sglang]`` on a GPU node), imported only when a
backend is constructed. The translation lives in two pure functions, ``to_sglang_request`` and
``from_sglang_output``, tested without sglang; the class is a thin shell around the engine.

NOT RUN HERE: sglang needs CUDA kernels; the CPU machines this project is developed on cannot start
it. The translation is tested against response dicts shaped as the sglang source builds them; the
engine calls below follow that source and were not executed.

What the code relies on (read in sgl-project/sglang main at commit 001067ff, which pins
sglang-kernel 0.4.6.post1; files under python/sglang/srt/):

- ``entrypoints/engine.py``: ``Engine(**ServerArgs)``; ``await Engine.async_generate(input_ids=...,
  sampling_params=..., return_logprob=True, rid=..., stream=False)`` returns one dict
  ``{"text", "output_ids", "meta_info"}``. ``Engine.update_weights_from_disk`` and ``flush_cache``
  use ``loop.run_until_complete`` and so cannot run inside a running event loop (a Serve replica):
  this backend awaits the ``tokenizer_manager`` coroutines they wrap instead.
- ``managers/tokenizer_manager.py``: ``meta_info`` has ``finish_reason`` (``{"type": "stop" |
  "length" | "abort", ...}``), ``prompt_tokens``, ``completion_tokens``, ``weight_version`` and, with
  ``return_logprob``, ``output_token_logprobs``: ``(logprob, token_id, text_or_None)`` per output
  token. ``abort_request(rid="", abort_all=False)`` sends an ``AbortReq`` to the scheduler; an
  aborted request still answers, with the tokens made so far and finish type ``abort``.
  ``update_weights_from_disk(UpdateWeightFromDiskReqInput, None)`` returns ``(success, message[,
  num_paused_requests])`` after in-flight requests drain (its writer lock).
- ``managers/data_parallel_controller.py``: an ``AbortReq`` is a control message, sent to every
  data-parallel rank's scheduler (each rank-0 TP scheduler broadcasts to its group): one
  ``abort_all`` reaches every worker of this engine, not one picked by a router.
- ``ray/engine.py`` (commit 01118259): ``RayEngine(placement_group=pg, **ServerArgs)`` runs the
  schedulers as Ray actors on a placement group's bundles (1 GPU per bundle).
- ``sampling/sampling_params.py``: ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1 = off),
  ``max_new_tokens`` (default 128), ``stop``, ``stop_token_ids``, ``ignore_eos``, ``sampling_seed``.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec

from rayapp.core.termination import EngineConnectionError
from rayapp.inference.client import (
    DEFAULT_MAX_NEW_TOKENS,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    validate_request,
)

INSTALL_HINT = "pip install rayapp[sglang] on a GPU node"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def to_sglang_request(req: GenerateRequest, max_context_len: int | None = None) -> dict[str, Any]:
    """Keyword arguments for ``Engine.async_generate``. ``max_new_tokens`` is always set (our default
    when None) and, given ``max_context_len``, clamped so the prompt plus the reply fit: sglang would
    reject the request, where the interface promises a LENGTH finish."""
    s = req.sampling
    max_new = s.max_new_tokens if s.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    if max_context_len is not None:
        max_new = min(max_new, max_context_len - len(req.input_ids))
    params: dict[str, Any] = {"max_new_tokens": max_new}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                         ("seed", "sampling_seed")):
        value = getattr(s, ours)
        if value is not None:
            params[theirs] = value
    if s.stop:
        params["stop"] = list(s.stop)
    if req.stop_token_ids:
        params["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        params["ignore_eos"] = True
    return {"input_ids": list(req.input_ids), "sampling_params": params, "return_logprob": True,
            "rid": req.request_id, "stream": False}


def finish_reason_from_sglang(reason: Any) -> FinishReason:
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in _FINISH:
        raise ValueError(f"unknown sglang finish_reason {reason!r}")
    return _FINISH[kind]


def from_sglang_output(request_id: str, out: dict[str, Any]) -> GenerateOutput:
    """A GenerateOutput from one non-streaming ``async_generate`` result. Raises ValueError when the
    answer breaks the interface (ids and log-probs disagree, no finish reason): a made-up log-prob
    would poison training, so none is invented."""
    meta = out.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    ids = out.get("output_ids")
    if ids is None and entries is not None:  # responses without output_ids still carry the ids here
        ids = [entry[1] for entry in entries]
    if ids is None:
        raise ValueError(f"sglang answer for {request_id!r} has no output_ids")
    entries = entries or []
    if len(entries) != len(ids):
        raise ValueError(f"sglang answer for {request_id!r} has {len(ids)} output ids but {len(entries)} "
                         "log-probs (was return_logprob set?)")
    logprobs = []
    for i, (entry, token) in enumerate(zip(entries, ids, strict=True)):
        logprob, entry_token = entry[0], entry[1]
        if logprob is None or (entry_token is not None and int(entry_token) != int(token)):
            raise ValueError(f"sglang answer for {request_id!r}: log-prob entry {i} {entry!r} does not "
                             f"match output token {token}")
        logprobs.append(min(0.0, float(logprob)))
    return GenerateOutput(
        request_id=request_id, output_ids=[int(t) for t in ids], logprobs=logprobs,
        finish_reason=finish_reason_from_sglang(meta.get("finish_reason")), text=out.get("text") or "",
        prompt_len=int(meta.get("prompt_tokens") or 0), engine="sglang",
        weight_version=str(meta.get("weight_version") or ""),
    )


def _import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise ImportError(f"the sglang inference backend needs the sglang package: {INSTALL_HINT} "
                          f"(import failed: {e})") from e
    return sglang


class SGLangBackend:
    """An sglang engine on this replica's GPUs (or, given ``placement_group``, sglang's RayEngine
    with its schedulers on that group's bundles). ``base_gpu_id`` counts within the GPUs Ray made
    visible to the replica. ``engine_kwargs`` go to sglang's ServerArgs unchanged."""

    name = "sglang"

    def __init__(self, model_path: str, tp_size: int = 1, mem_fraction_static: float = 0.8, base_gpu_id: int = 0,
                 placement_group: Any = None, request_timeout_s: float = 600.0, **engine_kwargs: Any):
        sglang = _import_sglang()
        kwargs = dict(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                      base_gpu_id=base_gpu_id, **engine_kwargs)
        if placement_group is not None:
            from sglang.srt.ray.engine import RayEngine

            engine = RayEngine(placement_group=placement_group, **kwargs)
        else:
            engine = sglang.Engine(**kwargs)
        self._engine, self.model_path, self.request_timeout_s = engine, model_path, request_timeout_s
        self._in_flight: set[str] = set()
        self._version = 0
        self._closed = False

    @property
    def _tm(self) -> Any:
        return self._engine.tokenizer_manager

    @property
    def max_context_len(self) -> int | None:
        tm = self._tm
        context = getattr(tm, "context_len", None)
        return None if context is None else int(context) - int(getattr(tm, "num_reserved_tokens", 0) or 0)

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        if self._closed:
            raise RuntimeError("the sglang backend is shut down")
        vocab = getattr(getattr(self._tm, "model_config", None), "vocab_size", None)
        validate_request(req, vocab)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._in_flight:
            raise ValueError(f"request_id {rid!r} is already in flight")
        kwargs = to_sglang_request(msgspec.structs.replace(req, request_id=rid), self.max_context_len)
        if kwargs["sampling_params"]["max_new_tokens"] <= 0:  # the prompt alone fills the context
            return GenerateOutput(rid, [], [], FinishReason.LENGTH, prompt_len=len(req.input_ids), engine=self.name)
        self._in_flight.add(rid)
        try:
            out = await asyncio.wait_for(self._engine.async_generate(**kwargs), self.request_timeout_s)
        except TimeoutError:
            self._tm.abort_request(rid=rid)
            raise TimeoutError(f"sglang request {rid!r} took over {self.request_timeout_s}s; aborted") from None
        except asyncio.CancelledError:  # the caller went on without it (a partial step): free its place at once
            self._tm.abort_request(rid=rid)
            raise
        except Exception as e:  # the engine is down or overloaded: classify as an infra failure
            if getattr(e, "status_code", None) in (500, 503):
                raise EngineConnectionError(f"sglang engine failed request {rid!r}: {e}") from e
            raise
        finally:
            self._in_flight.discard(rid)
        return from_sglang_output(rid, out)

    async def abort(self, request_id: str | None = None) -> int:
        if request_id is None:
            n = len(self._in_flight)
            try:
                self._tm.abort_request(abort_all=True)  # reaches every DP/TP scheduler of this engine
            except TypeError:  # sglang before abort_all: one AbortReq per request
                for rid in list(self._in_flight):
                    self._tm.abort_request(rid)
            return n
        if request_id not in self._in_flight:
            return 0
        self._tm.abort_request(rid=request_id)
        return 1

    async def health(self) -> dict[str, Any]:
        tm = getattr(self._engine, "tokenizer_manager", None)
        ok = not self._closed and tm is not None and not getattr(tm, "gracefully_exit", False)
        return {"ok": ok, "backend": self.name, "model": self.model_path, "in_flight": len(self._in_flight),
                "weight_version": self._version, "server_status": str(getattr(tm, "server_status", ""))}

    def _weights_request(self, path: str, version: int) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        try:  # the version shows up in every answer's meta_info afterwards
            return UpdateWeightFromDiskReqInput(model_path=path, weight_version=str(version))
        except TypeError:  # sglang before weight_version
            return UpdateWeightFromDiskReqInput(model_path=path)

    async def update_weights_from_disk(self, path: str, version: int | None = None) -> dict[str, Any]:
        """Load the trainer's checkpoint in place as ``version`` (default: one past the current; sglang
        waits for in-flight requests, then loads, and rolls back on failure). Raises ValueError when
        sglang refuses it."""
        version = self._version + 1 if version is None else version
        result = await asyncio.wait_for(self._tm.update_weights_from_disk(self._weights_request(path, version), None),
                                        self.request_timeout_s)
        success, message = result[0], result[1]
        if not success:
            raise ValueError(f"sglang could not load weights from {path!r}: {message}")
        self._version = version
        return {"ok": True, "path": path, "version": self._version, "message": message}

    async def flush_cache(self) -> bool:
        """Drop the radix (prefix) cache, e.g. after out-of-band weight changes."""
        out = await asyncio.wait_for(self._tm.flush_cache(), self.request_timeout_s)
        return bool(getattr(out, "success", out))

    def info(self) -> dict[str, Any]:
        tm = self._tm
        tok = getattr(tm, "tokenizer", None)
        args = getattr(self._engine, "server_args", None)
        return {
            "backend": self.name, "model_path": self.model_path,
            "tokenizer_path": getattr(args, "tokenizer_path", None) or self.model_path,
            "eos_token_id": getattr(tok, "eos_token_id", None), "pad_token_id": getattr(tok, "pad_token_id", None),
            "bos_token_id": getattr(tok, "bos_token_id", None),
            "chat_template": bool(getattr(tok, "chat_template", None)), "max_context_len": self.max_context_len,
            "tp_size": getattr(args, "tp_size", None), "dp_size": getattr(args, "dp_size", None),
            "weight_version": self._version,
        }

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()
