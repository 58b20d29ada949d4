"""BaseAgent: what an EvaluatorSpec's handler is (spec §4). Two phases run under the one token the
sample holds: ``run`` (the episode) returns an AgentResult (token ids, per-token log-probs, loss
mask, turns, the agent's own termination reason); ``evaluate`` (the verifier) returns the reward
dict, with at least ``"score"``."""

from __future__ import annotations

from abc import ABC, abstractmethod

from rayapp.episode import EpisodeContext
from rayapp.types import AgentResult, Sample


class BaseAgent(ABC):
    @abstractmethod
    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult: ...

    @abstractmethod
    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]: ...
