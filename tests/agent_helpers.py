"""Helpers shared by the agent tests: a scripted engine that speaks through the real tiny tokenizer,
a recorder of what an engine was sent and gave back, and a small episode context and sample."""

from __future__ import annotations

from rayapp.episode import EpisodeContext
from rayapp.inference.client import FinishReason, GenerateOutput
from rayapp.types import Sample, SamplingParams, StoppingCriteria

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'


class ScriptedEngine:
    """Answers each turn with the next scripted text, tokenized by the real tokenizer (so ids,
    text and eos are exactly what an engine would return); honours max_new_tokens and stop
    strings as the backends do (the ids end with the match, the text stops before it)."""

    def __init__(self, tok, model_dir, script):
        self.tok, self.model_dir, self.script, self.requests = tok, str(model_dir), list(script), []

    async def info(self):
        return {"tokenizer_path": self.model_dir}

    async def generate(self, req, timeout_s=None):
        self.requests.append(req)
        text = self.script.pop(0) if self.script else "The answer is 4."
        ids = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
        matches = [(text.index(s), s) for s in req.sampling.stop or [] if s in text]
        stop_at = None
        if matches:
            stop_at, found = min(matches)
            ids = self.tok.encode(text[: stop_at + len(found)], add_special_tokens=False)
        finish = FinishReason.STOP
        if req.sampling.max_new_tokens is not None and len(ids) > req.sampling.max_new_tokens:
            ids, finish, stop_at = ids[: req.sampling.max_new_tokens], FinishReason.LENGTH, None
        text = self.tok.decode(ids, skip_special_tokens=True)
        return GenerateOutput("r", ids, [-0.5] * len(ids), finish, text if stop_at is None else text[:stop_at],
                              engine="scripted")


def ctx(max_turns=4, max_context_len=None, token=None, stop=None):
    return EpisodeContext(0, token, StoppingCriteria(max_turns=max_turns, max_context_len=max_context_len),
                          SamplingParams(max_new_tokens=64, stop=stop))


def sample():
    return Sample("t", 0, "What is 2 + 2?", "4")


class InProcessEngine:
    """The engine client's shape over a backend in this process (the real hf engine in tests)."""

    def __init__(self, backend):
        self.backend = backend

    async def info(self):
        return self.backend.info()

    async def generate(self, req, timeout_s=None):
        return await self.backend.generate(req)


def recording(engine):
    engine.outputs, engine.texts, engine.logprobs, engine.sent = [], [], [], []
    real = engine.generate

    async def generate(req, timeout_s=None):
        engine.sent.append(req)
        out = await real(req, timeout_s)
        engine.outputs.append(out.output_ids)
        engine.texts.append(out.text)
        engine.logprobs.append(out.logprobs)
        return out

    engine.generate = generate
    return engine
