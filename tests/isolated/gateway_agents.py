"""Agents written against the OpenAI API for tests/isolated/test_gateway_serve.py, named by import path
in its recipe (this folder on the replicas' PYTHONPATH). They run inside the manager's replica and reach
the gateway through Serve's HTTP proxy with the openai client they are handed; of rayapp they take only
the texts the tiny model was taught with (the math env's system prompt and instruction)."""

from __future__ import annotations

import json

import openai

from rayapp.envs.agents.tools import describe
from rayapp.envs.math import INSTRUCTION


def _solved(prompt: str) -> tuple[str, str]:
    """The expression of "What is a op b?" and its value (the tool's result the agent hands back)."""
    expression = prompt.removeprefix("What is ").removesuffix("?")
    a, op, b = expression.split()
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    return expression, str(value)


async def chat(client: openai.AsyncOpenAI, task, sandbox) -> str:
    """Three calls, each extending the last: the question with a calculator call already answered in
    its history (a tool message, which the tiny model reads back, as the math env's math-read rows
    show it), then a follow-up streamed, then one not streamed; returns the first reply's text (the
    answer, read off the tool's result)."""
    expression, value = _solved(task.prompt)
    call = {"id": "call_calc", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    messages = [{"role": "system", "content": describe(["calculator"])},
                {"role": "user", "content": f"{task.prompt}\n{INSTRUCTION}"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_calc",
                 "content": json.dumps({"name": "calculator", "result": value})}]
    first = await client.chat.completions.create(model="rayapp", messages=messages, logprobs=True)
    assert first.choices[0].logprobs is not None  # the engine's own, per generated token
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Say it once more."}]
    text = ""
    async for chunk in await client.chat.completions.create(model="rayapp", messages=messages, stream=True):
        text += "".join(c.delta.content or "" for c in chunk.choices)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And once more."}]
    await client.chat.completions.create(model="rayapp", messages=messages)
    return first.choices[0].message.content or ""


async def forever(client: openai.AsyncOpenAI, task, sandbox) -> str:
    """Asks the same question again and again until the episode's clock stops it (mostly while a call
    is in flight); each ask starts a segment of its own (the history went back), so the context stays
    small and no budget but the time ends the episode."""
    while True:
        await client.chat.completions.create(model="rayapp", messages=[{"role": "user", "content": task.prompt}])
