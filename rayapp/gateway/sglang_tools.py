"""SGLang's own tool-call parsers behind the gateway: ``gateway.tool_parser: sglang:<name>``.

On a GPU cluster the engines are SGLang's, and the model's tool-call format is the one SGLang's
server parses with its ``--tool-call-parser`` (``qwen25``, ``llama3``, ``hermes``, ``kimi_k2``, ...).
This module hands the gateway that same parser (``FunctionCallParser`` with SGLang's detector of
that name), so a reply becomes OpenAI ``tool_calls`` exactly as SGLang's own OpenAI server would
make them; the default (``transformers``) is ``rayapp.gateway.tool_calls``. The parser runs where
the gateway does (the manager replica: the cluster image has sglang); ``rayapp validate`` checks
only the name's form, the manager checks that SGLang has it when it starts.
"""

from __future__ import annotations

from typing import Any

from rayapp.gateway.tool_calls import ParsedReply, ToolParser, openai_call

__all__ = ["sglang_parser"]

def sglang_parser(name: str) -> ToolParser:
    """SGLang's parser ``name`` as the gateway's; RuntimeError naming the problem where sglang is
    not installed or has no parser of that name."""
    try:
        import sglang
        from sglang.srt.entrypoints.openai.protocol import Tool
        from sglang.srt.function_call.function_call_parser import FunctionCallParser
    except ImportError as e:
        raise RuntimeError(f"tool_parser 'sglang:{name}' needs the sglang package where the manager runs "
                           f"({type(e).__name__}: {e})") from None
    known = FunctionCallParser.ToolCallParserEnum
    if name not in known:
        raise RuntimeError(f"SGLang {sglang.__version__} has no tool-call parser {name!r}; it has {sorted(known)}")

    def parse(text: str, tools: list[dict[str, Any]]) -> ParsedReply:
        try:
            parser = FunctionCallParser([Tool.model_validate(t) for t in tools], name)
            if not parser.has_tool_call(text):
                return ParsedReply(text, [])
            normal, items = parser.parse_non_stream(text)
        except (ValueError, KeyError, TypeError):  # a call region SGLang cannot read: the reply stays text
            return ParsedReply(text, [])
        calls = [openai_call({"name": c.name, "arguments": c.parameters}) for c in items]
        if not calls or any(c is None for c in calls):
            return ParsedReply(text, [])
        return ParsedReply((normal or "").strip() or None, calls)

    return parse
