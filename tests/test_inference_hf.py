"""The hf backend as a real engine on the tiny model, built offline once per session.

The model folder lives in $RAYAPP_CACHE when set, else in pytest's cache folder, so repeated runs skip
the build. No test touches the network: HF_HUB_OFFLINE is set and socket connects to anything but
loopback fail for the whole module (and in the second-process test).
"""

import ast
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from conftest import refuse_network
from safetensors.torch import load_file, save_file

from rayapp.core.convert import convert
from rayapp.envs.tiny_model_recipe import corpus_lines
from rayapp.inference import FinishReason, GenerateRequest, InferenceBackend, make_backend
from rayapp.inference.hf import HFBackend
from rayapp.inference.sampling import sample_next
from rayapp.inference.tiny_model import (
    MANIFEST,
    build_tokenizer,
    ensure_built,
    ensure_tiny_model,
    is_complete,
    load_tokenizer,
)
from rayapp.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module", autouse=True)
def no_network():
    with refuse_network():
        yield


@pytest.fixture(scope="session")
def backend(model_dir) -> HFBackend:
    return HFBackend(str(model_dir), max_concurrency=4, seed=0)


@pytest.fixture(scope="session")
def prompt(backend) -> list[int]:
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    return backend.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.fixture(scope="session")
def greedy(backend, prompt):
    return run(backend.generate(GenerateRequest(prompt, GREEDY)))


def long_request(prompt, n=900, rid=""):
    return GenerateRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=n), request_id=rid, ignore_eos=True)


async def wait_for_tokens(backend, rid, n=3):
    for _ in range(2000):
        state = backend._requests.get(rid)
        if state is not None and len(state.output_ids) >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid} made no progress")


def test_generates_real_text_with_logprobs(backend, greedy, prompt):
    assert greedy.finish_reason is FinishReason.STOP and greedy.output_ids[-1] == backend.tokenizer.eos_token_id
    assert greedy.text == backend.tokenizer.decode(greedy.output_ids, skip_special_tokens=True)
    assert greedy.text.startswith("The answer is ") and greedy.text.endswith(".")  # pretraining taught the format
    assert len(greedy.logprobs) == len(greedy.output_ids) and all(lp <= 0 for lp in greedy.logprobs)
    assert (greedy.prompt_len, greedy.engine, greedy.weight_version) == (len(prompt), "hf", 0)


def same(a, b) -> bool:
    """The same tokens, and log-probs equal but for float rounding: a request that reuses an earlier
    one's KV cache (``prefix_cache``) prefills in two pieces, which rounds differently (about 1e-7)."""
    return a.output_ids == b.output_ids and all(abs(x - y) < 1e-5 for x, y in zip(a.logprobs, b.logprobs, strict=True))


def test_greedy_is_deterministic_and_seeded_sampling_reproducible(backend, greedy, prompt):
    again = run(backend.generate(GenerateRequest(prompt, GREEDY)))
    assert same(again, greedy)

    def sampled(seed):
        params = SamplingParams(temperature=1.5, top_p=0.95, top_k=50, max_new_tokens=12, seed=seed)
        return run(backend.generate(GenerateRequest(prompt, params, ignore_eos=True)))

    first, second = sampled(7), sampled(7)
    assert same(first, second)
    assert len({tuple(sampled(s).output_ids) for s in range(1, 6)}) > 1


def test_finish_reasons_max_tokens_stop_token_stop_string(backend, greedy, prompt):
    out = run(backend.generate(GenerateRequest(prompt, SamplingParams(max_new_tokens=5), ignore_eos=True)))
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == len(out.logprobs) == 5

    stop_token = greedy.output_ids[2]
    out = run(backend.generate(GenerateRequest(prompt, GREEDY, stop_token_ids=[stop_token])))
    cut = greedy.output_ids.index(stop_token) + 1
    assert out.finish_reason is FinishReason.STOP and out.output_ids == greedy.output_ids[:cut]
    assert out.logprobs == greedy.logprobs[:cut]

    out = run(backend.generate(GenerateRequest(prompt, SamplingParams(temperature=0, stop=["answer"]))))
    assert out.finish_reason is FinishReason.STOP and out.text == "The "  # cut before the stop string
    assert greedy.output_ids[:len(out.output_ids)] == out.output_ids  # ids end at the token boundary
    # ... of the token that completed the match: nothing generated past it
    assert backend.tokenizer.decode(out.output_ids, skip_special_tokens=True).endswith("answer")
    assert len(out.output_ids) < len(greedy.output_ids)


def test_context_overflow_ends_with_length_not_a_crash(backend):
    limit = backend.max_context_len
    out = run(backend.generate(GenerateRequest([5] * (limit - 10), SamplingParams(max_new_tokens=50), ignore_eos=True)))
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == 10
    for n in (limit, limit + 200):
        out = run(backend.generate(GenerateRequest([5] * n, SamplingParams(max_new_tokens=5))))
        assert (out.finish_reason, out.output_ids, out.logprobs) == (FinishReason.LENGTH, [], [])


def test_abort_one_request_returns_partial_output(backend, prompt):
    async def main():
        task = asyncio.create_task(backend.generate(long_request(prompt, rid="victim")))
        await wait_for_tokens(backend, "victim")
        assert await backend.abort("victim") == 1
        out = await task
        assert await backend.abort("victim") == 0 and await backend.abort("never-seen") == 0
        return out

    out = run(main())
    assert out.finish_reason is FinishReason.ABORT and 0 < len(out.output_ids) < 900
    assert len(out.logprobs) == len(out.output_ids) and all(lp <= 0 for lp in out.logprobs)


def test_a_cancelled_request_is_dropped_and_frees_its_slot(model_dir, prompt):
    # a partial rollout step cancels an episode's pending generate: the engine stops decoding it
    one_slot = HFBackend(str(model_dir), max_concurrency=1)

    async def main():
        victim = asyncio.create_task(one_slot.generate(long_request(prompt, rid="victim")))
        await wait_for_tokens(one_slot, "victim")
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert (await one_slot.health())["running"] == 0 and "victim" not in one_slot._requests
        out = await asyncio.wait_for(one_slot.generate(long_request(prompt, n=4, rid="next")), 120)
        return out, await one_slot.health()

    out, health = run(main())
    assert out.finish_reason is FinishReason.LENGTH and len(out.output_ids) == 4  # the slot came back
    assert (health["in_flight"], health["running"], health["waiting"]) == (0, 0, 0)
    one_slot.shutdown()


def test_abort_all_reaches_running_and_waiting_requests(model_dir, prompt):
    one_slot = HFBackend(str(model_dir), max_concurrency=1)

    async def main():
        tasks = [asyncio.create_task(one_slot.generate(long_request(prompt, rid=f"r{i}"))) for i in range(3)]
        await wait_for_tokens(one_slot, "r0")
        health = await one_slot.health()
        assert (health["in_flight"], health["running"], health["waiting"]) == (3, 1, 2)
        assert await one_slot.abort() == 3
        outs = await asyncio.gather(*tasks)
        return outs, await one_slot.health()

    outs, health = run(main())
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT] * 3
    assert len(outs[0].output_ids) > 0 and outs[1].output_ids == outs[2].output_ids == []
    assert (health["in_flight"], health["running"], health["waiting"]) == (0, 0, 0)
    one_slot.shutdown()


def test_concurrent_requests_all_complete_with_the_same_results(backend, greedy, prompt):
    async def main():
        reqs = [GenerateRequest(prompt, GREEDY) for _ in range(6)]
        reqs += [GenerateRequest(prompt, SamplingParams(max_new_tokens=40), ignore_eos=True) for _ in range(4)]
        return await asyncio.gather(*(backend.generate(r) for r in reqs))

    outs = run(main())
    assert all(o.output_ids == greedy.output_ids for o in outs[:6])  # interleaving does not change results
    assert [len(o.output_ids) for o in outs[6:]] == [40] * 4 and len({o.request_id for o in outs}) == 10
    assert run(backend.health())["in_flight"] == 0


def test_update_weights_from_disk_changes_outputs_and_back(backend, model_dir, greedy, prompt, tmp_path):
    weights = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    save_file({k: v + 0.5 * torch.randn(v.shape, generator=gen) for k, v in weights.items()},
              str(tmp_path / "model.safetensors"))
    version = run(backend.health())["weight_version"]

    result = run(backend.update_weights_from_disk(str(tmp_path)))
    assert result == {"ok": True, "path": str(tmp_path), "version": version + 1}
    changed = run(backend.generate(GenerateRequest(prompt, GREEDY)))
    assert changed.logprobs != greedy.logprobs and changed.weight_version == version + 1

    assert run(backend.update_weights_from_disk(str(model_dir)))["version"] == version + 2
    back = run(backend.generate(GenerateRequest(prompt, GREEDY)))
    assert back.output_ids == greedy.output_ids  # the same weights again: the same answer, and its log-probs
    assert back.logprobs == pytest.approx(greedy.logprobs, abs=1e-5)  # to float noise (CPU threads' sums)


def test_bad_checkpoints_raise_and_change_nothing(backend, model_dir, greedy, prompt, tmp_path):
    version = run(backend.health())["weight_version"]
    with pytest.raises(ValueError, match=r"missing' refused: .*No such file"):
        run(backend.update_weights_from_disk(str(tmp_path / "missing")))
    weights = load_file(str(model_dir / "model.safetensors"))
    name = next(iter(weights))
    save_file({**weights, name: torch.zeros(3, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="do not fit the served model"):
        run(backend.update_weights_from_disk(str(tmp_path)))
    assert run(backend.health())["weight_version"] == version
    assert run(backend.generate(GenerateRequest(prompt, GREEDY))).output_ids == greedy.output_ids


def test_weight_update_waits_for_requests_in_flight(backend, model_dir, prompt):
    async def main():
        events = []
        req = GenerateRequest(prompt, SamplingParams(max_new_tokens=60), request_id="old", ignore_eos=True)
        running = asyncio.create_task(backend.generate(req))
        await wait_for_tokens(backend, "old")
        update = asyncio.create_task(backend.update_weights_from_disk(str(model_dir)))
        out = await running
        events.append(("request", out.weight_version, len(out.output_ids)))
        events.append(("update", (await update)["version"]))
        return events

    (_, old_version, n), (_, new_version) = run(main())
    assert n == 60 and old_version == new_version - 1


def test_health_and_info(backend, model_dir):
    health = run(backend.health())
    assert health["ok"] and health["backend"] == "hf" and health["model"] == str(model_dir)
    info = backend.info()
    assert (info["eos_token_id"], info["pad_token_id"], info["bos_token_id"]) == (2, 0, 1)
    assert info["chat_template"] and info["max_context_len"] == 1024 and info["tokenizer_path"] == str(model_dir)
    assert isinstance(backend, InferenceBackend)


def test_chat_template_round_trip_and_assistant_mask(model_dir):
    tok = load_tokenizer(model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 * 3?"},
            {"role": "assistant", "content": "The answer is 36."}, {"role": "tool", "content": '{"ok": true}'}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == ("<|bos|><|system|>Be brief.<|eos|><|user|>What is 12 * 3?<|eos|>"
                    '<|assistant|>The answer is 36.<|eos|><|tool|>{"ok": true}<|eos|><|assistant|>')
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    out = tok.apply_chat_template(msgs[:3], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(masked) == "The answer is 36.<|eos|>"
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


@pytest.mark.parametrize("req, field", [
    (GenerateRequest([]), "input_ids"),
    (GenerateRequest([1, -2]), r"input_ids\[1\]"),
    (GenerateRequest([1, 512]), r"input_ids\[1\]"),  # outside the vocabulary
    (GenerateRequest([1], stop_token_ids=[9999]), r"stop_token_ids\[0\]"),
    (GenerateRequest([1], SamplingParams(temperature=-0.1)), "temperature"),
    (GenerateRequest([1], SamplingParams(temperature=float("nan"))), "temperature"),
    (GenerateRequest([1], SamplingParams(top_p=0.0)), "top_p"),
    (GenerateRequest([1], SamplingParams(top_p=1.5)), "top_p"),
    (GenerateRequest([1], SamplingParams(temperature=float("inf"))), "temperature"),
    (GenerateRequest([1], SamplingParams(top_k=-2)), "top_k"),
    (GenerateRequest([1], SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    (GenerateRequest([1], SamplingParams(stop=[""])), "stop"),
    (GenerateRequest([1], SamplingParams(temperature="hot")), "temperature"),  # the Struct does not check types
])
def test_bad_requests_raise_one_clear_value_error(backend, req, field):
    with pytest.raises(ValueError, match=field):
        run(backend.generate(req))
    assert run(backend.health())["in_flight"] == 0


def test_top_k_zero_is_rejected_where_the_params_are_made():
    # -1 or >= 1 is a rule of the type: no SamplingParams with top_k 0 exists to reach a backend.
    with pytest.raises(ValueError, match=r"\$\.top_k: expected -1 \(off\) or int >= 1, got 0"):
        SamplingParams(top_k=0)
    with pytest.raises(ValueError, match=r"^generate request: \$\.sampling\.top_k: expected -1 \(off\) or int >= 1"):
        convert({"input_ids": [1], "sampling": {"top_k": 0}}, GenerateRequest, "generate request")


def test_duplicate_request_id(backend, prompt):
    async def main():
        task = asyncio.create_task(backend.generate(long_request(prompt, rid="dup")))
        await wait_for_tokens(backend, "dup", 1)
        with pytest.raises(ValueError, match="already in flight"):
            await backend.generate(GenerateRequest(prompt, request_id="dup"))
        await backend.abort("dup")
        return await task

    assert run(main()).finish_reason is FinishReason.ABORT


def test_sample_next_filters_and_reports_full_vocab_logprob():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5])
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0, 1.0, -1, None)[0] == 1
    for _ in range(20):
        assert sample_next(logits, 1.0, 1.0, 1, gen)[0] == 1  # top_k=1
        assert sample_next(logits, 1.0, 0.01, -1, gen)[0] == 1  # a tiny nucleus
        assert sample_next(logits, 2.0, 1.0, 2, gen)[0] in (1, 2)
    token, logprob = sample_next(logits, 2.0, 1.0, -1, gen)
    assert logprob == pytest.approx(float(torch.log_softmax(logits / 2.0, -1)[token]))


def test_make_backend_and_shutdown(model_dir, prompt):
    with pytest.raises(ValueError, match="unknown inference backend 'vllm'"):
        make_backend("vllm")
    hf = make_backend("hf", model_path=str(model_dir))
    assert isinstance(hf, HFBackend)
    hf.shutdown()
    assert not run(hf.health())["ok"]
    with pytest.raises(RuntimeError, match="shut down"):
        run(hf.generate(GenerateRequest(prompt)))
    with pytest.raises(ValueError, match="not a local model folder"):
        HFBackend("org/some-hub-model")


def test_build_is_idempotent_and_deterministic(cache_dir, model_dir):
    stamp = (model_dir / MANIFEST).stat().st_mtime_ns
    assert ensure_tiny_model(cache_dir) == model_dir and (model_dir / MANIFEST).stat().st_mtime_ns == stamp
    assert json.loads((model_dir / MANIFEST).read_text())["params"] > 0
    assert build_tokenizer(corpus_lines()).get_vocab() == load_tokenizer(model_dir).get_vocab()


def test_concurrent_builders_build_once_atomically(tmp_path):
    calls = []

    def slow_build(folder: Path) -> dict:
        calls.append(folder)
        (folder / "weights").write_text("w")
        time.sleep(0.2)
        return {"name": "fake"}

    dest = tmp_path / "models" / "fake"
    (dest.parent / ".fake.tmp-999-dead").mkdir(parents=True)  # a builder killed mid-way left this
    threads = [threading.Thread(target=ensure_built, args=(dest, slow_build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and is_complete(dest) and (dest / "weights").read_text() == "w"
    assert sorted(p.name for p in dest.parent.iterdir()) == [".fake.lock", "fake"]  # no temp folders left

    (dest / MANIFEST).write_text('{"recipe_version": -1}')  # an older recipe is rebuilt, not reused
    ensure_built(dest, slow_build)
    assert len(calls) == 2 and is_complete(dest)


def test_a_second_process_reuses_the_build_without_network(cache_dir, model_dir):
    stamp = (model_dir / MANIFEST).stat().st_mtime_ns
    script = f"""
import asyncio, json, socket
def refuse(*a, **k): raise OSError("network access attempted")
socket.socket.connect = refuse
socket.create_connection = refuse
from rayapp.inference import GenerateRequest, make_backend
from rayapp.envs.tiny_model_recipe import corpus_lines
from rayapp.types import SamplingParams
b = make_backend("hf", cache_dir={str(cache_dir)!r})
ids = b.tokenizer.apply_chat_template([{{"role": "user", "content": "What is 2 + 2?"}}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
out = asyncio.run(b.generate(GenerateRequest(ids, SamplingParams(temperature=0, max_new_tokens=16))))
print(json.dumps({{"path": b.model_path, "text": out.text}}))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAYAPP_CACHE": "/nonexistent-never-used"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["path"] == str(model_dir) and result["text"].startswith("The answer is")
    assert (model_dir / MANIFEST).stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_inference_package_never_imports_ray():
    for path in Path(__file__).parents[1].joinpath("rayapp", "inference").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n == "ray" or n.startswith("ray.")], path
