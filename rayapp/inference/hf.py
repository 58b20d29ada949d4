"""The ``hf`` backend: a real (small) engine on transformers, for CPU boxes and tests.

It tokenizes, runs an incremental decoding loop with a KV cache, samples, and returns the log-prob
of every chosen token. What it guarantees, beyond the client invariants:

- one worker thread owns the model: every forward pass and every weight load runs there, in FIFO
  order, so no two ever overlap; concurrent requests advance in turns of ``steps_per_call`` tokens;
- at most ``max_concurrency`` requests decode at once; the rest wait in arrival order (abortable);
- log-probs as ``rayapp.inference.sampling.sample_next`` reports them (over the full vocabulary,
  before top-k/top-p filtering, as a trainer recomputes them);
- a request never sees two weight versions: ``update_weights_from_disk`` waits until the requests
  in flight finish, holds new ones back, loads, then lets them run (a writer-preferring gate);
- nothing touches the network: the model folder must be local (default: ``ensure_tiny_model()``).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: this backend is offline

import torch

from rayapp.core.regular_file import open_regular
from rayapp.inference.client import (
    DEFAULT_MAX_NEW_TOKENS,
    FinishReason,
    GenerateOutput,
    GenerateRequest,
    validate_request,
)
from rayapp.inference.prefix_cache import PrefixCache
from rayapp.inference.sampling import sample_next
from rayapp.inference.tiny_model import ensure_tiny_model, load_tokenizer, quiet_progress
from rayapp.inference.weight_paths import checkpoint_files
from rayapp.record import WeightVersion

MAX_WEIGHT_FILE_BYTES = 1 << 40  # read whole into memory: the hf backend serves small models
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Gate:
    """Requests are readers, a weight update the writer. Writer-preferring: once an update is
    pending no new request enters, so updates cannot starve. Releases are synchronous (no await),
    which keeps them safe inside ``finally`` of a cancelled task."""

    def __init__(self):
        self.readers = 0
        self.writer = False
        self._wake: list[asyncio.Future] = []

    def _notify(self) -> None:
        for fut in self._wake:
            if not fut.done():
                fut.set_result(None)
        self._wake.clear()

    async def _wait(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._wake.append(fut)
        await fut

    async def acquire_read(self) -> None:
        while self.writer:
            await self._wait()
        self.readers += 1

    def release_read(self) -> None:
        self.readers -= 1
        self._notify()

    async def acquire_write(self) -> None:
        while self.writer:  # one update at a time
            await self._wait()
        self.writer = True
        try:
            while self.readers:
                await self._wait()
        except BaseException:
            self.release_write()
            raise

    def release_write(self) -> None:
        self.writer = False
        self._notify()


class _Request:
    """One request's decoding state. ``aborted`` is set by the event loop and read by the worker."""

    def __init__(self, rid: str, req: GenerateRequest, backend: HFBackend):
        s = req.sampling
        self.rid, self.input_ids = rid, list(req.input_ids)
        self.temperature = float(s.temperature) if s.temperature is not None else 1.0
        self.top_p = float(s.top_p) if s.top_p is not None else 1.0
        self.top_k = s.top_k if s.top_k is not None else -1
        max_new = s.max_new_tokens if s.max_new_tokens is not None else DEFAULT_MAX_NEW_TOKENS
        self.budget = min(max_new, backend.max_context_len - len(self.input_ids))  # <= 0: context full
        self.stop_strings = list(s.stop or [])
        self.stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else backend.eos_token_ids)
        seed = s.seed if s.seed is not None else backend._seed_rng.randrange(2**63)
        self.generator = torch.Generator(backend.device).manual_seed(seed) if self.temperature > 0 else None
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.past: Any = None  # the KV cache
        self.next_logits: torch.Tensor | None = None  # None until the prompt is prefilled
        self.finish: FinishReason | None = None
        self.text = ""
        self.stop_at: int | None = None  # where a matched stop string starts in the text
        self.aborted = False
        self.admit: asyncio.Future | None = None
        self.weight_version = backend._version


def _check_device(device: str) -> None:
    """A CUDA device this process sees (a Ray replica sees only the GPUs it reserved, numbered from
    0), else one ValueError naming it, before the model is loaded."""
    if torch.device(device).type == "cuda":
        # read from the name: torch wraps a large index (cuda:999 is cuda:-25)
        have, index = torch.cuda.device_count(), device.partition(":")[2] or "0"
        if not index.isdigit() or int(index) >= have:
            raise ValueError(f"device {device!r}: this process sees {have} CUDA device(s) (a Ray replica sees only "
                             "the GPUs its num_gpus reserves, numbered from 0)")


class HFBackend:
    """transformers on CPU (or any torch device) behind the InferenceBackend interface.

    ``model_path``: a local model folder (default: the tiny model, built under ``cache_dir``).
    ``max_concurrency``: requests decoding at once. ``seed``: makes unseeded requests reproducible
    in arrival order (a request's own ``sampling.seed`` always wins). ``num_threads``: torch
    intra-op threads (1 suits the tiny model). ``steps_per_call``: tokens per worker turn.
    ``prefix_cache``: finished requests' KV caches kept for a next turn that starts with their tokens
    (``rayapp.inference.prefix_cache``; 0: off)."""

    name = "hf"

    def __init__(self, model_path: str | None = None, device: str = "cpu", max_concurrency: int = 4,
                 dtype: str = "float32", seed: int | None = None, num_threads: int | None = None,
                 cache_dir: str | None = None, steps_per_call: int = 8, prefix_cache: int = 64):
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        _check_device(device)
        path = Path(model_path).expanduser() if model_path else ensure_tiny_model(cache_dir)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path {str(path)!r} is not a local model folder (no config.json); "
                             "the hf backend never downloads from a hub")
        from transformers import AutoModelForCausalLM

        # One intra-op thread by default: the tiny model's matrices are too small to split, replicas
        # share a node, and spinning OpenMP threads on a busy 2-core box cut throughput tenfold.
        self.num_threads = num_threads or 1
        torch.set_num_threads(self.num_threads)
        self.model_path, self.device, self.dtype = str(path), torch.device(device), _DTYPES[dtype]
        self.tokenizer = load_tokenizer(path)
        with quiet_progress():
            self.model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=self.dtype)
        self.model.to(self.device).eval()
        # transformers 5 renamed the KV-cache argument and output field ``past_key_values`` to ``cache``.
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_context_len = int(self.model.config.max_position_embeddings)
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos]
        self.eos_token_ids = {i for i in [*eos, self.tokenizer.eos_token_id] if i is not None}
        self.max_concurrency, self.steps_per_call = max_concurrency, max(1, steps_per_call)
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayapp-hf",
                                            initializer=torch.set_num_threads, initargs=(self.num_threads,))
        self._requests: dict[str, _Request] = {}
        self._running, self._waiting = 0, deque()  # decoding now; admission futures in arrival order
        self._gate = _Gate()
        self._version, self._weights_path, self._closed = 0, self.model_path, False
        self._prefix = PrefixCache(max_entries=prefix_cache)  # the worker thread's alone

    # -- the interface ----------------------------------------------------------------------------

    async def generate(self, req: GenerateRequest) -> GenerateOutput:
        if self._closed:
            raise RuntimeError("the hf backend is shut down")
        validate_request(req, self.vocab_size)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self._requests:
            raise ValueError(f"request_id {rid!r} is already in flight")
        state = self._requests[rid] = _Request(rid, req, self)
        try:
            await self._gate.acquire_read()
            try:
                if await self._admit(state):
                    try:
                        loop = asyncio.get_running_loop()
                        while state.finish is None:
                            if self._closed:  # shut down between two turns: no worker to ask
                                state.finish = FinishReason.ABORT
                                state.text = self.tokenizer.decode(state.output_ids, skip_special_tokens=True)
                                break
                            await loop.run_in_executor(self._executor, self._steps, state)
                    finally:
                        self._release()
                else:
                    state.finish = FinishReason.ABORT
            finally:
                self._gate.release_read()
        except BaseException:
            state.aborted = True  # cancelled: the worker drops this request at its next step
            raise
        finally:
            del self._requests[rid]
        return GenerateOutput(
            request_id=rid, output_ids=state.output_ids, logprobs=state.logprobs, finish_reason=state.finish,
            text=state.text, prompt_len=len(state.input_ids), engine=self.name,
            weight_version=state.weight_version,
        )

    async def abort(self, request_id: str | None = None) -> int:
        if request_id is None:
            targets = list(self._requests.values())
        else:
            targets = [self._requests[request_id]] if request_id in self._requests else []
        n = 0
        for state in targets:
            if state.finish is None and not state.aborted:
                state.aborted = True
                n += 1
                if state.admit is not None and not state.admit.done():
                    state.admit.set_result(False)  # still waiting for a slot: leave the queue now
        return n

    async def health(self) -> dict[str, Any]:
        return {
            "ok": not self._closed, "backend": self.name, "model": self.model_path,
            "in_flight": len(self._requests), "running": self._running,
            "waiting": sum(1 for f in self._waiting if not f.done()), "max_concurrency": self.max_concurrency,
            "weight_version": self._version, "weights_path": self._weights_path, "updating": self._gate.writer,
            "prefix_cache": self._prefix.stats(),
        }

    async def update_weights_from_disk(self, path: str, version: WeightVersion | None = None) -> dict[str, Any]:
        """Load safetensors weights (a model folder, a sharded index, or one file) into the live model,
        named ``version`` (default: one past the current). A checkpoint that does not fit the served
        model raises ValueError and changes nothing."""
        if self._closed:
            raise RuntimeError("the hf backend is shut down")
        weights = await asyncio.to_thread(self._read_weights, str(Path(path).expanduser()))
        await self._gate.acquire_write()
        try:
            version = await asyncio.get_running_loop().run_in_executor(
                self._executor, self._copy_weights, weights, str(path), version)
        finally:
            self._gate.release_write()
        return {"ok": True, "path": str(path), "version": version}

    def info(self) -> dict[str, Any]:
        tok = self.tokenizer
        return {
            "backend": self.name, "model_path": self.model_path, "tokenizer_path": self.model_path,
            "eos_token_id": tok.eos_token_id, "eos_token_ids": sorted(self.eos_token_ids),
            "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "vocab_size": self.vocab_size,
            "chat_template": bool(tok.chat_template), "max_context_len": self.max_context_len,
            "device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
            "weight_version": self._version,
        }

    def shutdown(self) -> None:
        """Abort everything in flight and stop the worker thread; later calls raise RuntimeError."""
        self._closed = True
        for state in self._requests.values():
            state.aborted = True
        # Queued turns still run (they see the flag and end at once), so no awaiting caller is
        # left with a cancelled future.
        self._executor.shutdown(wait=False, cancel_futures=False)

    # -- admission: at most max_concurrency decoding, the rest wait in order ----------------------

    async def _admit(self, state: _Request) -> bool:
        if state.aborted:
            return False
        while self._waiting and self._waiting[0].done():  # aborted waiters at the head
            self._waiting.popleft()
        if self._running < self.max_concurrency and not any(not f.done() for f in self._waiting):
            self._running += 1
            return True
        state.admit = asyncio.get_running_loop().create_future()
        self._waiting.append(state.admit)
        try:
            return await state.admit  # True: a finishing request handed us its slot
        except asyncio.CancelledError:
            if state.admit.done() and not state.admit.cancelled() and state.admit.result():
                self._release()  # the slot arrived as we were cancelled: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(True)  # hand the slot over; _running stays the same
                return
        self._running -= 1

    # -- the worker thread ------------------------------------------------------------------------

    def _forward(self, state: _Request, ids: list[int]) -> None:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{self._cache_arg: state.past})
        state.past, state.next_logits = getattr(out, self._cache_arg), out.logits[0, -1]

    def _steps(self, state: _Request) -> None:
        """Up to ``steps_per_call`` tokens of one request; sets ``state.finish`` when it ends."""
        with torch.inference_mode():
            for _ in range(self.steps_per_call):
                if state.aborted:
                    state.finish = FinishReason.ABORT
                elif state.next_logits is None and state.budget <= 0:
                    state.finish = FinishReason.LENGTH  # the prompt alone fills the context
                elif state.next_logits is None:
                    state.weight_version = self._version  # the weights this request runs on
                    hit = self._prefix.take(state.input_ids, self._version)
                    if hit is not None:  # an earlier turn's KV cache: prefill only what is new since
                        state.past, done = hit
                    self._forward(state, state.input_ids[done:] if hit is not None else state.input_ids)
                    continue
                else:
                    self._decode_one(state)
                if state.finish is not None:
                    if state.past is not None:  # kept for the episode's next turn, which starts with these tokens
                        self._prefix.put(state.input_ids + state.output_ids, state.past, state.weight_version)
                    state.past = state.next_logits = None
                    text = self.tokenizer.decode(state.output_ids, skip_special_tokens=True)
                    state.text = text[:state.stop_at] if state.stop_at is not None else text
                    return

    def _decode_one(self, state: _Request) -> None:
        token, logprob = sample_next(state.next_logits, state.temperature, state.top_p, state.top_k,
                                     state.generator)
        state.output_ids.append(token)
        state.logprobs.append(logprob)
        if token in state.stop_ids:
            state.finish = FinishReason.STOP
        elif state.stop_strings:
            text = self.tokenizer.decode(state.output_ids, skip_special_tokens=True)
            found = [i for i in (text.find(s) for s in state.stop_strings) if i >= 0]
            if found:
                state.finish, state.stop_at = FinishReason.STOP, min(found)
        if state.finish is None and len(state.output_ids) >= state.budget:
            state.finish = FinishReason.LENGTH  # max_new_tokens, or the context is full
        if state.finish is None:
            self._forward(state, [token])

    # -- weights ----------------------------------------------------------------------------------

    def _read_weights(self, path: str) -> dict[str, torch.Tensor]:
        """Read and check a checkpoint against the served model (off the worker thread). The files are
        those ``checkpoint_files`` lists inside the checkpoint itself (the engine deployment has
        confined ``path`` to the recipe's roots), each opened non-blocking as a regular file."""
        from safetensors.torch import load

        here = path if os.path.isdir(path) else os.path.dirname(path)
        weights: dict[str, torch.Tensor] = {}
        for f in checkpoint_files(path, [here]):
            handle, _ = open_regular(f, MAX_WEIGHT_FILE_BYTES)
            with handle:
                weights.update(load(handle.read()))
        live = self.model.state_dict()
        groups: dict[int, list[str]] = {}  # tied parameters share storage: one of a group suffices
        for name, tensor in live.items():
            groups.setdefault(tensor.data_ptr(), []).append(name)
        problems = [f"unexpected {n}" for n in sorted(weights.keys() - live.keys())]
        problems += [f"missing {names[0]}" for names in groups.values() if not any(n in weights for n in names)]
        problems += [f"{n}: shape {tuple(t.shape)} != {tuple(live[n].shape)}"
                     for n, t in weights.items() if n in live and t.shape != live[n].shape]
        for names in groups.values():
            present = [weights[n] for n in names if n in weights]
            if any(not torch.equal(present[0], t) for t in present[1:]):
                problems.append(f"tied weights {names} differ in the checkpoint")
        if problems:
            raise ValueError(f"weights at {str(path)!r} do not fit the served model: " + "; ".join(problems[:8]))
        return weights

    def _copy_weights(self, weights: dict[str, torch.Tensor], path: str,
                      version: WeightVersion | None) -> WeightVersion:
        """On the worker, so the version moves with the weights even if the caller was cancelled."""
        live = self.model.state_dict()  # tensors share storage with the parameters
        with torch.no_grad():
            for name, tensor in weights.items():
                live[name].copy_(tensor)
        self._prefix.clear()  # keys and values of the old weights
        self._version, self._weights_path = self._version + 1 if version is None else version, path
        return self._version
