"""Environment turns as tokens: the one place where what an environment says between model turns (a
tool's result, a gym environment's observation) becomes token ids, and where an episode's token data
grows.

The environment's tokens are the model's own chat template's rendering: the text the template adds
for the environment's messages (and the next generation prompt) after a closed assistant turn, so a
trainer sees exactly what a chat-formatted conversation would hold, never a re-tokenisation of what
the model generated. This assumes a template that renders each message on its own, as chat
templates do; one that does not is refused with an error.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import msgspec

from rayapp.inference.client import GenerateOutput, context_filled
from rayapp.record import TerminationReason
from rayapp.types import SamplingParams

# a closed conversation to render after: the delta after it is what the template adds for the new messages
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
_SENTINEL = "\u2063rayapp-turn-end-probe\u2063"  # content whose rendering shows the template's turn end


def template_delta(tok: Any, messages: Sequence[dict[str, Any]]) -> str:
    """The chat template's text for ``messages`` and the next generation prompt, after a closed
    assistant turn (``messages`` may be empty: the generation prompt alone)."""
    before = tok.apply_chat_template(_PROBE, tokenize=False)
    after = tok.apply_chat_template([*_PROBE, *messages], add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template does not render messages one by one: an environment turn "
                         "cannot be appended to the model's tokens")
    return after[len(before):]


@functools.lru_cache(maxsize=16)
def turn_end(tok: Any) -> tuple[str, tuple[int, ...]]:
    """What the template writes after an assistant message's content (``<|im_end|>\\n``, or the eos
    alone): its text and ids, from the rendering of a probe conversation."""
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    closed = tok.apply_chat_template(probe, tokenize=False)
    if _SENTINEL not in closed:
        raise ValueError("the chat template does not render an assistant message's content as given")
    text = closed[closed.rindex(_SENTINEL) + len(_SENTINEL):]
    return text, tuple(tok.encode(text, add_special_tokens=False))


def closing_text(tok: Any, turn_ids: Sequence[int]) -> str:
    """The part of the template's turn end that a model turn of ``turn_ids`` left out: all of it when
    the engine stopped before the end-of-turn token (at a stop string), what follows that token (a
    ChatML template's newline) when the engine generated it."""
    text, ids = turn_end(tok)
    done = max(k for k in range(len(ids) + 1) if k == 0 or tuple(turn_ids[-k:]) == ids[:k])
    return text[len(tok.decode(list(ids[:done]), skip_special_tokens=False)):]


def observation_tokens(tok: Any, messages: Sequence[dict[str, Any]], turn_ids: Sequence[int],
                       room: int | None) -> tuple[list[int], bool]:
    """The environment's tokens after a model turn that produced ``turn_ids``: what closes the turn
    as the template does (``closing_text``), then ``template_delta``, tokenized together. Cut to the
    ``room`` left in the context (None: no limit); the flag says whether it was cut."""
    env = tok.encode(closing_text(tok, turn_ids) + template_delta(tok, messages), add_special_tokens=False)
    if room is not None and len(env) > room:
        return env[:room], True
    return env, False


class TokenData:
    """An episode's token data as it grows: ``ids`` (prompt first), and the response's ``mask`` and
    ``logprobs``. Model tokens go in with weight 1 (or a DAgger roll-in's 0) and the engine's
    log-probs; environment tokens with weight 0 and log-prob 0.0."""

    def __init__(self, prompt: list[int]):
        self.ids, self.mask, self.logprobs = prompt, [], []

    def add(self, ids: list[int], weight: int, logprobs: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [weight] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


def turn_budget(sampling: SamplingParams, limit: int | None, used: int) -> tuple[SamplingParams, int | None] | None:
    """The next model turn's sampling, its ``max_new_tokens`` capped to the room the context limit
    leaves after ``used`` tokens, and that room (None: no limit); None when no room is left. The
    sampling is a copy: the request is this turn's state, whoever keeps it (a DAgger label records it)."""
    room = None if limit is None else limit - used
    if room is not None and room < 1:
        return None
    cap = sampling.max_new_tokens if room is None else min(room, sampling.max_new_tokens or room)
    return msgspec.structs.replace(sampling, max_new_tokens=cap), room


def length_reason(sampling: SamplingParams, room: int | None, out: GenerateOutput) -> TerminationReason:
    """Why a turn that ran out of tokens (``out``, sampled with ``sampling``) ends the episode: the
    context is full when the turn's cap was the room left in it, or when the engine's own window (it
    may be smaller than ``max_context_len``) ended the turn short of its cap; else the turn's own
    ``max_new_tokens`` ended it."""
    if (room is not None and sampling.max_new_tokens == room) or context_filled(out, sampling.max_new_tokens):
        return TerminationReason.MAX_CONTEXT_LEN
    return TerminationReason.LENGTH
