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

from collections.abc import Sequence
from typing import Any

import msgspec

from rayapp.inference.client import GenerateOutput, context_filled
from rayapp.record import TerminationReason
from rayapp.types import SamplingParams

# a closed conversation to render after: the delta after it is what the template adds for the new messages
_PROBE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def template_delta(tok: Any, messages: Sequence[dict[str, Any]]) -> list[int]:
    """The chat template's tokens for ``messages`` and the next generation prompt, after a closed
    assistant turn (``messages`` may be empty: the generation prompt alone)."""
    before = tok.apply_chat_template(_PROBE, tokenize=False)
    after = tok.apply_chat_template([*_PROBE, *messages], add_generation_prompt=True, tokenize=False)
    if not after.startswith(before):
        raise ValueError("the chat template does not render messages one by one: an environment turn "
                         "cannot be appended to the model's tokens")
    return tok.encode(after[len(before):], add_special_tokens=False)


def observation_tokens(tok: Any, messages: Sequence[dict[str, Any]], turn_ids: Sequence[int],
                       room: int | None) -> tuple[list[int], bool]:
    """The environment's tokens after a model turn that produced ``turn_ids``: the eos that closes
    the turn where the engine stopped short of it (at a stop string), then ``template_delta``. Cut
    to the ``room`` left in the context (None: no limit); the flag says whether it was cut."""
    env = template_delta(tok, messages)
    if list(turn_ids[-1:]) != [tok.eos_token_id]:
        env = [tok.eos_token_id, *env]  # close the model's turn the way the template does
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
