"""SGLangBackend over a real in-process SGLang engine on CPU with the tiny model (``make test-sglang``).

Skipped outside that lane (``make test`` leaves the folder out too); inside it, which
``SGLANG_USE_CPU_ENGINE=1`` marks, a broken install fails the lane instead of skipping it. One engine
serves the whole module (a start takes about half a minute here): the tests run in file order and
the last one shuts it down. Every coroutine runs on the one event loop the engine was built on:
SGLang's tokenizer manager ties its receive loop to the loop of the first request, so a fresh
``asyncio.run`` per test would wait forever on the second.

The KV pool is capped (``max_total_tokens``): on CPU, ``mem_fraction_static`` sizes it from the
machine's RAM, 17 GB on a 24 GB machine, which starves everything else."""

from __future__ import annotations

import asyncio
import os
import shutil

import pytest

if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
    pytest.skip("the real-engine lane: make test-sglang", allow_module_level=True)

import sglang  # noqa: F401  (the lane's install: an import failure is the lane's failure)
from safetensors.torch import load_file, save_file

from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.arithmetic import verify
from rayapp.episode import EpisodeContext
from rayapp.inference import GenerateRequest
from rayapp.inference.client import FinishReason, GenerationCut, generate_abortable
from rayapp.inference.sglang import SGLangBackend
from rayapp.inference.tiny_model import ensure_tiny_model
from rayapp.record import EpisodeRecord, TerminationReason, TurnRecord
from rayapp.steps.partial import staleness
from rayapp.types import Sample, SamplingParams, StoppingCriteria

PROMPT = [1, 4, 302, 271]
KV_TOKENS = 4096
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def backend(loop):
    b = SGLangBackend(str(ensure_tiny_model()), device="cpu", max_total_tokens=KV_TOKENS, log_level="error")
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def run(loop, backend):
    return loop.run_until_complete


def long_request(rid: str = "") -> GenerateRequest:
    """A request that runs until it is aborted (the tiny model makes a few hundred tokens a second here)."""
    return GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=3000), request_id=rid, ignore_eos=True)


async def in_flight(backend: SGLangBackend, n: int) -> None:
    """Until ``n`` requests run in the engine and each has made some tokens."""
    while (await backend.health())["in_flight"] < n:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)


def test_greedy_generation_is_repeatable_and_logprobs_line_up(backend, run):
    req = GenerateRequest(PROMPT, GREEDY, ignore_eos=True)
    a, b = run(backend.generate(req)), run(backend.generate(req))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 8
    assert len(a.logprobs) == 8 and all(lp <= 0 for lp in a.logprobs)
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert a.finish_reason == FinishReason.LENGTH and a.prompt_len == len(PROMPT) and a.engine == "sglang"


def test_stop_token_id_ends_the_reply_and_is_kept(backend, run):
    free = run(backend.generate(GenerateRequest(PROMPT, GREEDY, ignore_eos=True)))
    stop = free.output_ids[2]
    assert 2 not in free.output_ids[:3]  # the model's eos would stop it first
    out = run(backend.generate(GenerateRequest(PROMPT, GREEDY, stop_token_ids=[stop])))
    assert out.finish_reason == FinishReason.STOP
    assert out.output_ids[-1] == stop and out.output_ids == free.output_ids[:free.output_ids.index(stop) + 1]


def test_stop_string_ends_the_reply_and_the_text_is_cut_before_it(backend, run):
    free = run(backend.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=16),
                                                ignore_eos=True)))
    stop = free.text.strip()[-2:]  # a string the greedy reply is known to reach
    assert stop, free
    out = run(backend.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=16, stop=[stop]),
                                               ignore_eos=True)))
    assert out.finish_reason == FinishReason.STOP and stop not in out.text
    assert free.text.startswith(out.text) and len(out.output_ids) <= len(free.output_ids)


def test_abort_one_request_returns_its_tokens_so_far(backend, run):
    async def main():
        task = asyncio.ensure_future(backend.generate(long_request("lone")))
        await in_flight(backend, 1)
        assert await backend.abort("lone") == 1 and await backend.abort("not-running") == 0
        return await asyncio.wait_for(task, 30)

    out = run(main())
    assert out.finish_reason == FinishReason.ABORT and 0 < len(out.output_ids) < 3000
    assert len(out.logprobs) == len(out.output_ids)


def test_abort_all_ends_every_request(backend, run):
    async def main():
        tasks = [asyncio.ensure_future(backend.generate(long_request())) for _ in range(3)]
        await in_flight(backend, 3)
        assert await backend.abort() == 3
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)

    assert {o.finish_reason for o in run(main())} == {FinishReason.ABORT}
    assert run(backend.health())["in_flight"] == 0


def test_a_cancelled_caller_gets_a_cut_with_the_tokens_made(backend, run):
    async def main():
        call = asyncio.ensure_future(generate_abortable(backend, long_request()))
        await in_flight(backend, 1)
        call.cancel()
        with pytest.raises(GenerationCut) as cut:
            await asyncio.wait_for(call, 30)
        return cut.value.output

    kept = run(main())
    assert kept is not None and kept.finish_reason == FinishReason.ABORT and kept.output_ids
    assert run(backend.health())["in_flight"] == 0


def test_a_caller_that_gives_up_has_its_request_aborted_in_sglang(backend, run):
    """A caller cancelled while it awaits ``generate`` (what a Serve replica's call sees when its
    caller gives up): the backend aborts the request in SGLang, and counts how SGLang ended it: abort,
    not a reply run to its 3,000 tokens."""
    async def main():
        task = asyncio.ensure_future(backend.generate(long_request()))
        await in_flight(backend, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):
            if backend.given_up:
                break
            await asyncio.sleep(0.01)
        return await backend.health()

    health = run(main())
    assert health["given_up"] == {"abort": 1} and health["in_flight"] == health["engine_in_flight"] == 0


def test_a_request_over_its_time_is_aborted_and_the_engine_serves_on(backend, run):
    backend.request_timeout_s = 0.5
    try:
        with pytest.raises(TimeoutError, match=r"took over 0\.5s; aborted"):
            run(backend.generate(long_request()))
    finally:
        backend.request_timeout_s = 600.0
    assert run(backend.health())["in_flight"] == 0
    assert run(backend.generate(GenerateRequest(PROMPT, GREEDY))).output_ids
    assert backend.given_up == {"abort": 2}  # SGLang's answer to the timed-out one came back too


def test_flush_cache_and_abort_with_nothing_in_flight(backend, run):
    assert run(backend.flush_cache()) is True
    assert run(backend.abort()) == 0
    assert run(backend.abort("no-such-request")) == 0


# The defects of issue 20, each shown on the real engine (they run before any weight update).

def test_weights_before_any_update_are_version_0_and_their_staleness_counts(backend, run):
    """Defect 2: SGLang names the weights it started with "default"; the partial-rollout code read that
    as the current step, so a turn made before any update looked fresh however old it was."""
    out = run(backend.generate(GenerateRequest(PROMPT, GREEDY)))
    assert out.weight_version == 0 == run(backend.health())["weight_version"]
    carried = Sample("t", 0, "p", episode=EpisodeRecord(turn_records=[TurnRecord(1, "policy",
                                                                                 weight_version=out.weight_version)]))
    assert staleness(carried, 3) == 3


def test_a_prompt_past_the_engines_input_limit_ends_as_length(backend, run):
    """Defect 1: SGLang refuses a prompt of ``max_req_input_len`` tokens or more (its own report, here
    min(context - 1, KV pool - 1) - 5 = 1018) with a ValueError; the backend let prompts up to the
    context through. Now such a turn ends as LENGTH with nothing generated, as the hf engine's does when
    the prompt fills its context, and the one just inside the limit still runs."""
    engine_limit = backend._tm.max_req_input_len
    assert engine_limit < backend._tm.context_len - 1
    over = run(backend.generate(GenerateRequest([5] * engine_limit, GREEDY)))
    assert (over.finish_reason, over.output_ids, over.prompt_len) == (FinishReason.LENGTH, [], engine_limit)
    inside = run(backend.generate(GenerateRequest([5] * (engine_limit - 1), GREEDY, ignore_eos=True)))
    assert inside.finish_reason == FinishReason.LENGTH and 1 <= len(inside.output_ids) <= 8
    assert backend.info()["max_prompt_len"] == engine_limit - 1


class Client:
    """The engine client's shape (what an agent holds), in process over the backend."""

    def __init__(self, backend: SGLangBackend):
        self.backend = backend

    async def info(self) -> dict:
        return self.backend.info()

    async def generate(self, req: GenerateRequest, timeout_s: float | None = None):
        return await self.backend.generate(req)

    async def abort(self, request_id: str | None = None) -> int:
        return await self.backend.abort(request_id)


@pytest.mark.parametrize("agent", [ChatAgent, ToolAgent])
def test_an_episode_whose_prompt_passes_the_engines_limit_ends_as_max_context(backend, run, agent):
    """Defect 1, the episode's side: a turn whose prompt the engine will not take ends the episode
    with the max_context termination, not as a reply cut by its token budget. The agent's window is
    the engine's context plus room (what a KV pool smaller than the context does to an agent whose
    max_context_len equals SGLang's context_length): the agent sees room for the turn's 16 tokens,
    the engine takes none of them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_model()), local_files_only=True)
    limit = backend.info()["max_prompt_len"]

    def prompt_len(text: str) -> int:
        return len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))

    text = "7" * (limit + 2 - prompt_len(""))  # one token per digit
    assert prompt_len(text) == limit + 2
    ctx = EpisodeContext(0, None, StoppingCriteria(max_turns=1, max_context_len=2 * backend.max_context_len),
                         SamplingParams(temperature=0, max_new_tokens=16))
    result = run(agent(Client(backend), verify).run(Sample("long-prompt", 0, text), ctx))
    assert result.termination_reason is TerminationReason.MAX_CONTEXT_LEN and result.truncated
    # the tool agent's prompt is longer still (its tools' system prompt), as far inside its window
    assert result.response_length == 0 and limit + 2 <= len(result.tokens) < backend.max_context_len + 64


def test_a_seed_is_refused_where_the_engine_would_ignore_it(backend, run):
    """Defect 3: SGLang uses ``sampling_seed`` only when started with enable_deterministic_inference;
    without it a seeded request was silently unseeded. Now it is refused, naming the field and the
    switch; greedy requests (a seed changes nothing there) and unseeded ones run."""
    seeded = SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)
    with pytest.raises(ValueError, match=r"seed.*enable_deterministic_inference"):
        run(backend.generate(GenerateRequest(PROMPT, seeded)))
    greedy = run(backend.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=8, seed=7))))
    assert greedy.output_ids == run(backend.generate(GenerateRequest(PROMPT, GREEDY))).output_ids
    assert run(backend.health())["in_flight"] == 0


def test_health_reports_the_running_engine_up(backend, run):
    """Defect 4: health read SGLang's ``server_status``, which only its HTTP server moves on from
    Starting: an in-process engine that was serving reported Starting forever."""
    health = run(backend.health())
    assert health["ok"] is True and health["server_status"] == "Up"


def test_aborting_one_request_leaves_one_whose_id_it_prefixes(backend, run):
    """Defect 5: SGLang aborts every request whose id *starts with* the one named; ids the caller chose
    ("job", "job-2") made aborting one abort both. The ids the engine sees are now all of one length,
    so none is a prefix of another."""
    async def main():
        first = asyncio.ensure_future(backend.generate(long_request("job")))
        second = asyncio.ensure_future(backend.generate(long_request("job-2")))
        await in_flight(backend, 2)
        assert await backend.abort("job") == 1
        aborted = await asyncio.wait_for(first, 30)
        await asyncio.sleep(0.5)
        still_running = not second.done()
        await backend.abort("job-2")
        return aborted, still_running, await asyncio.wait_for(second, 30)

    aborted, still_running, second = run(main())
    assert aborted.request_id == "job" and aborted.finish_reason == FinishReason.ABORT
    assert still_running and second.request_id == "job-2" and len(second.output_ids) > len(aborted.output_ids)


def test_weights_from_disk_change_the_answers_and_name_the_version(backend, run, tmp_path):
    before = run(backend.generate(GenerateRequest(PROMPT, GREEDY, ignore_eos=True)))
    model = ensure_tiny_model()
    changed = tmp_path / "step-1"
    shutil.copytree(model, changed)
    weights = load_file(changed / "model.safetensors")
    head = next(k for k in weights if "lm_head" in k or "embed_tokens" in k)
    weights[head] = weights[head].flip(0).contiguous()  # another model: its greedy reply differs
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    reply = run(backend.update_weights_from_disk(str(changed)))
    assert reply["ok"] and reply["version"] == 1
    after = run(backend.generate(GenerateRequest(PROMPT, GREEDY, ignore_eos=True)))
    assert after.weight_version == 1 and after.output_ids != before.output_ids

    assert run(backend.update_weights_from_disk(str(model), 2))["version"] == 2
    back = run(backend.generate(GenerateRequest(PROMPT, GREEDY, ignore_eos=True)))
    assert back.weight_version == 2 and back.output_ids == before.output_ids
    assert backend.info()["weight_version"] == 2


def test_shutdown_stops_the_engine(backend, run):
    backend.shutdown()
    assert run(backend.health())["ok"] is False
    with pytest.raises(RuntimeError, match="shut down"):
        run(backend.generate(GenerateRequest(PROMPT, GREEDY)))
