"""Tool calls: how a model asks for one, how it is parsed, and the tools agents ship with.

The model writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Parsing never
raises: a malformed or unknown call becomes an observation that tells the model what was wrong,
so a bad format costs the model a turn, not the episode.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
STOP_STRINGS = ["</tool_call>"]  # generation pauses here so the environment can answer


def with_tool_stops(stop: list[str] | None) -> list[str]:
    """The sampling's own stop strings, then the tool-call ones it lacks."""
    own = list(stop or [])
    return own + [s for s in STOP_STRINGS if s not in own]


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any] = {}


class ParsedTurn(msgspec.Struct, frozen=True):
    """What one assistant turn asked for: a call, a parse error to report, or neither (final)."""

    call: ToolCall | None = None
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.call is None and self.error is None


def parse_tool_call(text: str) -> ParsedTurn:
    match = TOOL_CALL.search(text)
    if match is None:
        return ParsedTurn()
    body = match.group(1).strip()
    try:
        call = msgspec.json.decode(body, type=ToolCall)
    except msgspec.DecodeError as e:
        return ParsedTurn(error=f"malformed tool call: {e}. Write <tool_call>{{\"name\": \"...\", "
                                f"\"arguments\": {{...}}}}</tool_call>")
    return ParsedTurn(call=call)


# A tool takes (arguments, sandbox or None) and returns the observation text.
ToolFn = Callable[[dict[str, Any], Any], Awaitable[str]]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
        ast.Div: operator.truediv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node: ast.AST) -> float:
    """Arithmetic only: numbers and + - * / // %, never names or calls."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / // % are allowed")


async def calculator(arguments: dict[str, Any], sandbox: Any = None) -> str:
    expr = str(arguments.get("expression", ""))
    if len(expr) > 200:
        return "error: expression longer than 200 characters"
    try:
        value = _evaluate(ast.parse(expr, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value) if float(value).is_integer() else value)


async def bash(arguments: dict[str, Any], sandbox: Any) -> str:
    result = await sandbox.exec(str(arguments.get("command", "")), timeout_s=arguments.get("timeout_s"))
    note = " (timed out)" if result.timed_out else ""
    return f"exit code {result.exit_code}{note}\n{result.stdout}{result.stderr}"[-4000:]


async def read_file(arguments: dict[str, Any], sandbox: Any) -> str:
    try:
        return (await sandbox.read_file(str(arguments.get("path", ""))))[-8000:]
    except (OSError, ValueError) as e:
        return f"error: {e}"


async def write_file(arguments: dict[str, Any], sandbox: Any) -> str:
    path = str(arguments.get("path", ""))
    try:
        await sandbox.write_file(path, str(arguments.get("content", "")))
    except (OSError, ValueError) as e:
        return f"error: {e}"
    return f"wrote {path}"


TOOLS: dict[str, ToolFn] = {"calculator": calculator, "bash": bash, "read_file": read_file,
                            "write_file": write_file}
SANDBOX_TOOLS = {"bash", "read_file", "write_file"}


def describe(tools: list[str]) -> str:
    """The system-prompt text that tells the model how to call ``tools``."""
    return ("You can call tools. Write <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call> and wait for "
            "the result. Tools: " + ", ".join(tools) + ". When you are done, answer without a tool call.")


def tool_result_message(name: str, text: str) -> dict[str, str]:
    return {"role": "tool", "content": json.dumps({"name": name, "result": text})[:8000]}
