"""SGLangBackend over a real in-process SGLang engine on CPU with the tiny model (make test-sglang).

Skipped where sglang is not importable (the main venv), so ``make test`` is unaffected."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("sglang", exc_type=ImportError)

from rayapp.inference import GenerateRequest
from rayapp.inference.client import FinishReason
from rayapp.inference.sglang import SGLangBackend
from rayapp.inference.tiny_model import ensure_tiny_model
from rayapp.types import SamplingParams

PROMPT = [1, 4, 302, 271]


@pytest.fixture(scope="module")
def backend():
    b = SGLangBackend(str(ensure_tiny_model()), device="cpu", mem_fraction_static=0.8, log_level="error")
    yield b
    b.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_greedy_generation_is_repeatable_and_logprobs_line_up(backend):
    req = GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=8), ignore_eos=True)
    a, b = run(backend.generate(req)), run(backend.generate(req))
    assert a.output_ids == b.output_ids and len(a.output_ids) == 8
    assert len(a.logprobs) == 8 and all(lp <= 0 for lp in a.logprobs)
    assert a.finish_reason == FinishReason.LENGTH and a.prompt_len == len(PROMPT)


def test_stop_token_id_ends_the_reply(backend):
    free = run(backend.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=8),
                                                ignore_eos=True)))
    stop = free.output_ids[2]
    out = run(backend.generate(GenerateRequest(PROMPT, SamplingParams(temperature=0, max_new_tokens=8),
                                               stop_token_ids=[stop], ignore_eos=True)))
    assert out.finish_reason == FinishReason.STOP
    assert out.output_ids[-1] == stop and len(out.output_ids) <= 3


def test_flush_cache_and_abort_with_nothing_in_flight(backend):
    assert run(backend.flush_cache()) is True
    assert run(backend.abort()) == 0
    assert run(backend.abort("no-such-request")) == 0
