"""The ``sglang`` backend for GPU clusters: an ``sglang.Engine`` behind the InferenceBackend interface.

It exists so a GPU run gets batched generation at speed with the same interface, abort and weight
versions as the hf backend. ``sglang`` is an optional extra, imported only when a backend is built;
the translation lives in two pure functions, ``to_sglang_request`` and ``from_sglang_output``,
tested without sglang, and the class is a thin shell around the engine. Invariant: the engine never
sees the caller's request ids (each request gets a uuid4 hex of its own, none a prefix of another),
so an abort stops exactly the request it names. How the backend differs from hf, and the sglang
API it relies on: docs/cluster.md, "The sglang backend".
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
from rayapp.record import WeightVersion, weight_version_of

INSTALL_HINT = "pip install rayapp[sglang] on a GPU node"
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def to_sglang_request(req: GenerateRequest, max_context_len: int | None = None,
                      deterministic: bool = False) -> dict[str, Any]:
    """Keyword arguments for ``Engine.async_generate``. ``max_new_tokens`` is always set (our default
    when None) and, given ``max_context_len``, clamped so the prompt plus the reply fit: sglang would
    reject the request, where the interface promises a LENGTH finish. A seed is sent only to an engine
    started with ``enable_deterministic_inference`` (``deterministic``): any other ignores it, so a
    sampled request with one is refused; ``ignore_eos`` with ``stop_token_ids`` is refused (sglang's
    ``ignore_eos`` ignores both)."""
    s = req.sampling
    seed = s.seed if s.temperature != 0 else None  # greedy: the seed changes nothing
    if seed is not None and not deterministic:
        raise ValueError("sampling.seed: this sglang engine would ignore it (sglang seeds sampling only when "
                         "started with enable_deterministic_inference: true in the engine's options); "
                         "leave seed unset or start the engine so")
    if req.ignore_eos and req.stop_token_ids:
        raise ValueError("stop_token_ids with ignore_eos: sglang's ignore_eos switches off stop_token_ids too")
    max_new = s.max_new_tokens if s.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
    if max_context_len is not None:
        max_new = min(max_new, max_context_len - len(req.input_ids))
    params: dict[str, Any] = {"max_new_tokens": max_new}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(s, name)
        if value is not None:
            params[name] = value
    if seed is not None:
        params["sampling_seed"] = seed
    if s.stop:
        params["stop"] = list(s.stop)
    if req.stop_token_ids:
        params["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        params["ignore_eos"] = True
    return {"input_ids": list(req.input_ids), "sampling_params": params, "return_logprob": True,
            "rid": req.request_id, "stream": False}


def engine_rid() -> str:
    """The id the engine sees for one request: a uuid4 hex, always 32 characters, so none is a prefix
    of another (sglang's abort matches by prefix)."""
    return uuid.uuid4().hex


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
        weight_version=weight_version_of(meta.get("weight_version"), f"sglang answer for {request_id!r}"),
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
    visible to the replica. ``engine_kwargs`` go to sglang's ServerArgs unchanged, but for
    ``weight_version``: the backend names the versions (0 at the start)."""

    name = "sglang"

    def __init__(self, model_path: str, tp_size: int = 1, mem_fraction_static: float = 0.8, base_gpu_id: int = 0,
                 placement_group: Any = None, request_timeout_s: float = 600.0, **engine_kwargs: Any):
        if "weight_version" in engine_kwargs:
            raise ValueError("sglang engine option weight_version: the backend names weight versions itself "
                             "(0 at the start, then each update's); leave it out")
        sglang = _import_sglang()
        kwargs = dict(model_path=model_path, tp_size=tp_size, mem_fraction_static=mem_fraction_static,
                      base_gpu_id=base_gpu_id, weight_version="0", **engine_kwargs)
        if placement_group is not None:
            from sglang.srt.ray.engine import RayEngine

            engine = RayEngine(placement_group=placement_group, **kwargs)
        else:
            engine = sglang.Engine(**kwargs)
        self._engine, self.model_path, self.request_timeout_s = engine, model_path, request_timeout_s
        self._in_flight: dict[str, str] = {}  # the caller's request id -> the engine's
        self.given_up: dict[str, int] = {}  # requests whose caller gave up, by how sglang ended them (_settle)
        self._version = 0
        self._closed = False
        self._deterministic = bool(getattr(getattr(engine, "server_args", None), "enable_deterministic_inference",
                                           False))
        self._mark_up()

    def _mark_up(self) -> None:
        """The engine is built and serving: say so where sglang's HTTP server would after its warm-up."""
        tm = getattr(self._engine, "tokenizer_manager", None)
        if tm is not None and hasattr(tm, "server_status"):
            from sglang.srt.managers.tokenizer_manager import ServerStatus

            tm.server_status = ServerStatus.Up

    @property
    def _tm(self) -> Any:
        return self._engine.tokenizer_manager

    @property
    def max_context_len(self) -> int | None:
        tm = self._tm
        context = getattr(tm, "context_len", None)
        return None if context is None else int(context) - int(getattr(tm, "num_reserved_tokens", 0) or 0)

    @property
    def max_prompt_len(self) -> int | None:
        """The longest prompt the engine takes: it refuses ``max_req_input_len`` tokens or more, and the
        context must keep room for one token."""
        limits = [n - 1 for n in (getattr(self._tm, "max_req_input_len", None), self.max_context_len)
                  if n is not None]
        return min(limits) if limits else None

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        if self._closed:
            raise RuntimeError("the sglang backend is shut down")
        vocab = getattr(getattr(self._tm, "model_config", None), "vocab_size", None)
        validate_request(req, vocab)
        caller_id, rid = req.request_id, engine_rid()
        caller_id = caller_id or rid
        if caller_id in self._in_flight:
            raise ValueError(f"request_id {caller_id!r} is already in flight")
        kwargs = to_sglang_request(msgspec.structs.replace(req, request_id=rid), self.max_context_len,
                                   self._deterministic)
        limit = self.max_prompt_len
        if kwargs["sampling_params"]["max_new_tokens"] <= 0 or (limit is not None and len(req.input_ids) > limit):
            # the prompt alone fills what the engine takes: the turn ends as the context's end
            return GenerateOutput(caller_id, [], [], FinishReason.LENGTH, prompt_len=len(req.input_ids),
                                  engine=self.name, weight_version=self._version)
        self._in_flight[caller_id] = rid
        # The engine's call in a task of its own: a caller that gives up aborts the request in sglang, and
        # sglang's answer still comes back (to ``_settle``), saying whether the abort stopped it.
        call = asyncio.ensure_future(self._engine.async_generate(**kwargs))
        try:
            out = await asyncio.wait_for(asyncio.shield(call), self.request_timeout_s)
        except TimeoutError:
            self._tm.abort_request(rid=rid)
            self._settle(call)
            raise TimeoutError(f"sglang request {caller_id!r} took over {self.request_timeout_s}s; aborted") from None
        except asyncio.CancelledError:  # the caller went on without it (a partial step): free its place at once
            self._tm.abort_request(rid=rid)
            self._settle(call)
            raise
        except Exception as e:  # the engine is down or overloaded: classify as an infra failure
            if getattr(e, "status_code", None) in (500, 503):
                raise EngineConnectionError(f"sglang engine failed request {caller_id!r}: {e}") from e
            raise
        finally:
            self._in_flight.pop(caller_id, None)
        return from_sglang_output(caller_id, out)

    def _settle(self, call: asyncio.Future) -> None:
        """Count how sglang ended a request no caller waits for any more (``health()["given_up"]``:
        ``abort`` when the abort stopped it; ``stop``/``length`` when it ran to its end, which an abort
        that never reached the engine leaves); one that gives no answer within the request timeout is
        cancelled."""
        def done(c: asyncio.Future) -> None:
            timer.cancel()
            if c.cancelled() or c.exception() is not None:
                how = "no answer"
            else:
                how = str(((c.result().get("meta_info") or {}).get("finish_reason") or {}).get("type", "unknown"))
            self.given_up[how] = self.given_up.get(how, 0) + 1

        timer = asyncio.get_running_loop().call_later(self.request_timeout_s, call.cancel)
        call.add_done_callback(done)

    async def abort(self, request_id: str | None = None) -> int:
        if request_id is None:
            n = len(self._in_flight)
            try:
                self._tm.abort_request(abort_all=True)  # reaches every DP/TP scheduler of this engine
            except TypeError:  # sglang before abort_all: one AbortReq per request
                for rid in list(self._in_flight.values()):
                    self._tm.abort_request(rid)
            return n
        rid = self._in_flight.get(request_id)
        if rid is None:
            return 0
        self._tm.abort_request(rid=rid)
        return 1

    async def health(self) -> dict[str, Any]:
        tm = getattr(self._engine, "tokenizer_manager", None)
        healthy = getattr(tm, "is_healthy", None)  # sglang's own: serving, not unhealthy, not shutting down
        ok = not self._closed and tm is not None and (healthy() if healthy is not None
                                                      else not getattr(tm, "gracefully_exit", False))
        status = getattr(tm, "server_status", None)
        # The requests sglang itself still holds: one whose caller gave up stays there until sglang has
        # aborted it (``in_flight`` counts only the callers this backend still answers).
        held = getattr(tm, "rid_to_state", None)
        return {"ok": ok, "backend": self.name, "model": self.model_path, "in_flight": len(self._in_flight),
                "engine_in_flight": None if held is None else len(held), "given_up": dict(self.given_up),
                "weight_version": self._version, "server_status": getattr(status, "name", str(status or ""))}

    def _weights_request(self, path: str, version: int) -> Any:
        from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

        try:  # the version shows up in every answer's meta_info afterwards
            return UpdateWeightFromDiskReqInput(model_path=path, weight_version=str(version))
        except TypeError:  # sglang before weight_version
            return UpdateWeightFromDiskReqInput(model_path=path)

    async def update_weights_from_disk(self, path: str, version: WeightVersion | None = None) -> dict[str, Any]:
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
            "max_prompt_len": self.max_prompt_len,
            "tp_size": getattr(args, "tp_size", None), "dp_size": getattr(args, "dp_size", None),
            "weight_version": self._version,
        }

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()
