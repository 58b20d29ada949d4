"""A calculator agent, written against the OpenAI API and nothing else: it would run the same against
any OpenAI-compatible server. rayapp runs it as an episode by handing ``solve`` a client pointed at
the episode's own base URL and key on its gateway (the recipe's ``gateway.agent``).

The agent offers one function tool, ``calculator``, runs the tool-call loop itself (the model asks,
the agent computes and answers with a ``tool`` message, the model goes on) and returns its final
answer text, which the verifier reads.
"""

from __future__ import annotations

import ast
import json
import operator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the client is handed in: openai is needed only to name its type (and imports slowly)
    import openai

MAX_CALLS = 3  # model calls per problem; the recipe's max_turns bounds them too
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression of numbers and + - * / // %.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node: ast.AST) -> float:
    """Numbers and the operators above only: never a name, an attribute or a call."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError("only numbers and + - * / // % are allowed")


def calculator(arguments: str) -> str:
    """The tool: the model's JSON arguments in, the result (or what was wrong) out."""
    try:
        expression = str(json.loads(arguments)["expression"])[:200]
        value = _value(ast.parse(expression, mode="eval").body)
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value) if float(value).is_integer() else value)


async def solve(client: openai.AsyncOpenAI, task, sandbox) -> str:
    """Answer ``task.prompt`` (e.g. "What is 12 * 34?"), calling the calculator as the model asks."""
    messages: list[dict] = [{"role": "user", "content": task.prompt}]
    text = ""
    for _ in range(MAX_CALLS):
        reply = await client.chat.completions.create(model="rayapp", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        text = message.content or ""
        calls = message.tool_calls or []
        tool_calls = [{"id": c.id, "type": "function",
                       "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in calls]
        messages.append({"role": "assistant", "content": text, **({"tool_calls": tool_calls} if calls else {})})
        if not calls:
            break
        for call in calls:
            # the result as JSON naming its tool: the shape the tiny CPU model learnt to read back
            result = json.dumps({"name": call.function.name, "result": calculator(call.function.arguments)})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return text
