"""The sglang backend without sglang: request/response translation against answers shaped as
sglang's TokenizerManager builds them, the lazy-import error, and the thin class over a stand-in
engine. The real engine runs in the lane of tests/sglang_engine (``make test-sglang``, CPU) and in the
GPU smoke test at the end (skipped on CPU machines)."""

import asyncio
import json
import os
import sys
import types

import pytest

from rayapp.core.termination import EngineConnectionError
from rayapp.inference import FinishReason, GenerateRequest, make_backend
from rayapp.inference import sglang as sglang_backend
from rayapp.inference.sglang import SGLangBackend, from_sglang_output, to_sglang_request
from rayapp.types import SamplingParams


def run(coro):
    return asyncio.run(coro)


def answer(ids, logprobs, finish, text="", prompt_tokens=10, **meta):
    """A non-streaming ``async_generate`` result (tokenizer_manager._handle_batch_output)."""
    return {"text": text, "output_ids": list(ids), "meta_info": {
        "id": "rid", "finish_reason": finish, "prompt_tokens": prompt_tokens, "weight_version": "0",
        "completion_tokens": len(ids), "cached_tokens": 0, "e2e_latency": 0.01, "input_token_logprobs": [],
        "output_token_logprobs": [(lp, t, None) for lp, t in zip(logprobs, ids, strict=True)],
        "output_token_logprobs_length": len(ids), **meta}}


def test_request_translation():
    req = GenerateRequest([1, 4, 302], SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=64,
                                                       stop=["\n\n"], seed=3),
                          request_id="r1", stop_token_ids=[2, 7])
    assert to_sglang_request(req, deterministic=True) == {
        "input_ids": [1, 4, 302], "rid": "r1", "return_logprob": True, "stream": False,
        "sampling_params": {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "stop": ["\n\n"],
                            "sampling_seed": 3, "stop_token_ids": [2, 7]}}
    plain = to_sglang_request(GenerateRequest([1, 2], request_id="r2"))
    assert plain["sampling_params"] == {"max_new_tokens": 128}  # unset fields keep sglang's defaults
    clamped = to_sglang_request(GenerateRequest([1] * 1000, SamplingParams(max_new_tokens=100)), max_context_len=1024)
    assert clamped["sampling_params"]["max_new_tokens"] == 24  # the context bounds the reply


def test_requests_sglang_would_not_honour_are_refused():
    # an engine without enable_deterministic_inference ignores sampling_seed: a seeded sampled request is refused
    with pytest.raises(ValueError, match=r"sampling\.seed.*enable_deterministic_inference"):
        to_sglang_request(GenerateRequest([1], SamplingParams(temperature=0.7, seed=3)))
    greedy = to_sglang_request(GenerateRequest([1], SamplingParams(temperature=0, seed=3)))
    assert "sampling_seed" not in greedy["sampling_params"]  # a seed changes nothing in a greedy request
    # sglang's ignore_eos switches the stop ids off too
    with pytest.raises(ValueError, match="stop_token_ids with ignore_eos"):
        to_sglang_request(GenerateRequest([1], stop_token_ids=[2], ignore_eos=True))
    assert to_sglang_request(GenerateRequest([1], ignore_eos=True))["sampling_params"]["ignore_eos"] is True


def test_response_translation_finish_reasons():
    out = from_sglang_output("r", answer([279, 287, 2], [-0.1, -0.2, -0.3], {"type": "stop", "matched": 2},
                                         text="The answer", weight_version="3"))
    assert (out.output_ids, out.logprobs, out.finish_reason) == ([279, 287, 2], [-0.1, -0.2, -0.3], FinishReason.STOP)
    assert (out.text, out.prompt_len, out.engine, out.weight_version) == ("The answer", 10, "sglang", 3)
    matched_str = answer([5, 6], [-1.0, -2.0], {"type": "stop", "matched": "\n\n"})
    assert from_sglang_output("r", matched_str).finish_reason is FinishReason.STOP
    length = answer([5, 6], [-1.0, -2.0], {"type": "length", "length": 2})
    assert from_sglang_output("r", length).finish_reason is FinishReason.LENGTH
    running_abort = answer([5], [-0.5], {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
    assert from_sglang_output("r", running_abort).output_ids == [5]
    # _handle_abort_req: a request aborted while still queued
    queued = {"text": "", "output_ids": [], "meta_info": {
        "id": "r", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "0", "e2e_latency": 0.0, "completion_tokens": 0, "input_token_logprobs": [],
        "output_token_logprobs": [], "output_token_logprobs_length": 0}}
    out = from_sglang_output("r", queued)
    assert (out.finish_reason, out.output_ids, out.logprobs, out.prompt_len) == (FinishReason.ABORT, [], [], 0)


def test_response_translation_variants_and_errors():
    over_http = json.loads(json.dumps(answer([3, 4], [-0.25, 1e-7], "length")))  # tuples became lists
    out = from_sglang_output("r", over_http)
    assert out.logprobs == [-0.25, 0.0] and out.finish_reason is FinishReason.LENGTH  # rounding above 0 clipped
    no_ids = answer([3, 4], [-1.0, -1.0], {"type": "stop"})
    del no_ids["output_ids"]
    assert from_sglang_output("r", no_ids).output_ids == [3, 4]

    no_logprobs = answer([3, 4], [-1.0, -1.0], {"type": "stop"})
    del no_logprobs["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="2 output ids but 0 log-probs"):
        from_sglang_output("r", no_logprobs)
    wrong_token = answer([3, 4], [-1.0, -1.0], {"type": "stop"})
    wrong_token["meta_info"]["output_token_logprobs"][1] = (-1.0, 9, None)
    with pytest.raises(ValueError, match="does not match output token 4"):
        from_sglang_output("r", wrong_token)
    for finish in (None, {"type": "weird"}):
        with pytest.raises(ValueError, match="finish_reason"):
            from_sglang_output("r", answer([3], [-1.0], finish))
    # sglang reports its weight version as text: read as the int every backend reports, once, here
    assert from_sglang_output("r", answer([3], [-1.0], "length", weight_version="12")).weight_version == 12
    assert from_sglang_output("r", answer([3], [-1.0], "length", weight_version=None)).weight_version is None
    for bad in ("default", "-1", "1.5"):
        with pytest.raises(ValueError, match=rf"sglang answer for 'r': weight_version '{bad}' is not"):
            from_sglang_output("r", answer([3], [-1.0], "length", weight_version=bad))


def test_missing_sglang_gives_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` raise ImportError
    with pytest.raises(ImportError, match=r"pip install rayapp\[sglang\] on a GPU node"):
        SGLangBackend("some/model")
    with pytest.raises(ImportError, match="on a GPU node"):
        make_backend("sglang", model_path="some/model")


class FakeTokenizerManager:
    """Stands in for sglang's TokenizerManager: the calls this backend makes, recorded."""

    # max_req_input_len as sglang reports it: min(context - 1, KV pool - 1) - 5
    context_len, num_reserved_tokens, max_req_input_len, gracefully_exit = 64, 0, 58, False

    class model_config:  # attribute-shaped like sglang's ModelConfig
        vocab_size = 512

    def __init__(self):
        self.aborts: list[tuple[str, bool]] = []
        self.update_result = (True, "Succeeded to update model weights.", 0)

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborts.append((rid, abort_all))

    async def update_weights_from_disk(self, obj, request):
        return self.update_result


class FakeEngine:
    def __init__(self):
        self.tokenizer_manager = FakeTokenizerManager()
        self.calls: list[dict] = []
        self.fail_with: Exception | None = None
        self.shut = False

    async def async_generate(self, **kwargs):
        self.calls.append(kwargs)
        if self.fail_with is not None:
            raise self.fail_with
        rid, made = kwargs["rid"], []
        for token in range(10, 10 + kwargs["sampling_params"]["max_new_tokens"]):
            if any(r == rid or every for r, every in self.tokenizer_manager.aborts):
                return answer(made, [-1.0] * len(made), {"type": "abort", "message": "Aborted"})
            made.append(token)
            await asyncio.sleep(0.005)
        return answer(made, [-0.5] * len(made), {"type": "length", "length": len(made)})

    def shutdown(self):
        self.shut = True


def test_thin_class_over_a_stand_in_engine(monkeypatch):
    engine = FakeEngine()
    made = {}

    def fake_engine(**kwargs):
        made.update(kwargs)
        return engine

    # The real constructor builds the engine through sglang.Engine; a stand-in module hands it ours.
    monkeypatch.setattr(sglang_backend, "_import_sglang", lambda: types.SimpleNamespace(Engine=fake_engine))
    backend = SGLangBackend(model_path="/models/m", tp_size=2, attention_backend="triton")
    assert made == {"model_path": "/models/m", "tp_size": 2, "mem_fraction_static": 0.8, "base_gpu_id": 0,
                    "weight_version": "0", "attention_backend": "triton"}  # one version scheme: 0 at the start
    with pytest.raises(ValueError, match="weight_version"):
        SGLangBackend(model_path="/models/m", weight_version="default")

    async def main():
        out = await backend.generate(GenerateRequest([1, 2, 3], SamplingParams(max_new_tokens=3), request_id="a"))
        assert (out.output_ids, out.finish_reason, out.engine) == ([10, 11, 12], FinishReason.LENGTH, "sglang")
        clamped = await backend.generate(GenerateRequest([1] * 57, SamplingParams(max_new_tokens=50)))
        assert len(clamped.output_ids) == 7 and engine.calls[-1]["sampling_params"]["max_new_tokens"] == 7
        # the engine refuses prompts of max_req_input_len or more: the turn ends as LENGTH, nothing sent
        full = await backend.generate(GenerateRequest([1] * 58))
        assert (full.finish_reason, full.output_ids, len(engine.calls)) == (FinishReason.LENGTH, [], 2)
        assert full.weight_version == 0

        task = asyncio.create_task(backend.generate(GenerateRequest([1], SamplingParams(max_new_tokens=50),
                                                                    request_id="b")))
        await asyncio.sleep(0.02)
        assert (await backend.health())["in_flight"] == 1
        assert await backend.abort("b") == 1 and await backend.abort("zzz") == 0
        aborted = await task
        assert aborted.finish_reason is FinishReason.ABORT and 0 < len(aborted.output_ids) < 50
        assert aborted.request_id == "b"  # the caller's id comes back; the engine saw its own

        cancelled = asyncio.create_task(backend.generate(GenerateRequest([1], SamplingParams(max_new_tokens=50),
                                                                         request_id="c")))
        await asyncio.sleep(0.02)
        cancelled.cancel()  # the caller stops waiting: the request is aborted in the engine
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert engine.tokenizer_manager.aborts[-1] == (engine.calls[-1]["rid"], False)
        assert (await backend.health())["in_flight"] == 0
        await asyncio.sleep(0.05)  # the engine's answer to the abort, which no caller waits for, is counted
        assert (await backend.health())["given_up"] == {"abort": 1}
        # sglang aborts by id prefix: the ids it sees are all 32 hex characters, none a prefix of another
        rids = [c["rid"] for c in engine.calls]
        assert len(set(rids)) == len(rids) and {len(r) for r in rids} == {32}
        assert all(int(r, 16) >= 0 for r in rids) and "a" not in rids and "b" not in rids

        tasks = [asyncio.create_task(backend.generate(GenerateRequest([1], SamplingParams(max_new_tokens=50))))
                 for _ in range(3)]
        await asyncio.sleep(0.02)
        assert await backend.abort() == 3
        assert engine.tokenizer_manager.aborts[-1] == ("", True)  # one abort_all, to every scheduler
        assert {o.finish_reason for o in await asyncio.gather(*tasks)} == {FinishReason.ABORT}

        with pytest.raises(ValueError, match="input_ids"):
            await backend.generate(GenerateRequest([1, 512]))  # the engine's vocabulary bounds the ids
        engine.fail_with = type("HTTPException", (Exception,), {"status_code": 503})("overloaded")
        with pytest.raises(EngineConnectionError, match="overloaded"):
            await backend.generate(GenerateRequest([1]))

        monkeypatch.setattr(backend, "_weights_request", lambda path, version: {"model_path": path})
        assert await backend.update_weights_from_disk("/ckpt/1") == {
            "ok": True, "path": "/ckpt/1", "version": 1, "message": "Succeeded to update model weights."}
        assert (await backend.update_weights_from_disk("/ckpt/1", 1))["version"] == 1  # as the manager names it
        engine.tokenizer_manager.update_result = (False, "shape mismatch")
        with pytest.raises(ValueError, match="shape mismatch"):
            await backend.update_weights_from_disk("/ckpt/2")
        return await backend.health()

    health = run(main())
    assert health == {"ok": True, "backend": "sglang", "model": "/models/m", "in_flight": 0, "weight_version": 1,
                      "engine_in_flight": None, "given_up": {"abort": 1}, "server_status": ""}  # real: "Up"
    assert backend.info()["max_context_len"] == 64 and backend.info()["max_prompt_len"] == 57
    backend.shutdown()
    assert engine.shut and not run(backend.health())["ok"]


def test_sglang_engine_smoke_on_a_gpu_node():
    """Runs only where sglang and a GPU exist; never on the CPU machines this project is built on."""
    pytest.importorskip("sglang")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("sglang needs a CUDA GPU")
    from rayapp.inference.tiny_model import ensure_tiny_model

    # The tiny model's head_dim is 16: the triton attention backend takes it; bigger models need neither.
    model = os.environ.get("RAYAPP_SGLANG_TEST_MODEL") or str(ensure_tiny_model())
    backend = make_backend("sglang", model_path=model, mem_fraction_static=0.3, attention_backend="triton",
                           disable_cuda_graph=True)
    try:
        async def main():
            ids = [1, 4, 302, 271, 325, 322, 332, 37, 2, 5]
            out = await backend.generate(GenerateRequest(ids, SamplingParams(temperature=0, max_new_tokens=16)))
            assert out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and out.output_ids
            assert len(out.logprobs) == len(out.output_ids) and all(lp <= 0 for lp in out.logprobs)
            long = asyncio.create_task(backend.generate(
                GenerateRequest(ids, SamplingParams(max_new_tokens=500), ignore_eos=True)))
            await asyncio.sleep(0.5)
            assert await backend.abort() >= 1
            assert (await long).finish_reason is FinishReason.ABORT
            assert (await backend.update_weights_from_disk(model))["ok"]
            assert (await backend.health())["ok"]

        run(main())
    finally:
        backend.shutdown()
