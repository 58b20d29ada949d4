"""The agent: rayapp's single-turn ChatAgent with one worked example ahead of the question. Built
per evaluator from ``AgentDeps`` (the engine, the bundle executor and the verifier the recipe chose)."""

from __future__ import annotations

from typing import Any

from rayapp import AgentDeps, ChatAgent, Sample

SYSTEM = "You reverse words. Reply with the reversed word only."
EXAMPLE = [{"role": "user", "content": "Reverse the word 'cat'."}, {"role": "assistant", "content": "tac"}]


class WordAgent(ChatAgent):
    def __init__(self, deps: AgentDeps):
        super().__init__(deps.engine, deps.verify, deps.executor)

    def messages(self, sample: Sample) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": str(sample.prompt)}]
