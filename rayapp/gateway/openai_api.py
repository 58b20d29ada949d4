"""The OpenAI-compatible request door of the agent gateway (issue: "Any agent, unchanged").

What an agent written against the OpenAI API sends, typed: ``ChatCompletionRequest`` and
``CompletionRequest``, decoded through the project's one input door (``core.convert``), so a body
that does not fit is one error naming the JSON path. Options the gateway cannot honour are refused by
name, never ignored: a silently ignored ``n: 4`` or ``logit_bias`` would change what the agent
believes it trained on. Errors leave in OpenAI's own JSON shape (``{"error": {"message", "type",
"param", "code"}}``) with the status OpenAI gives them, so the SDKs raise their usual exceptions
(``AuthenticationError`` on 401, ``NotFoundError`` on 404, ``BadRequestError`` on 400, ...).

Pure: no Ray, no HTTP server; the deployment that serves the routes builds on this.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rayapp.core.convert import InputError, decode
from rayapp.types import MAX_COUNT, SamplingParams

__all__ = ["ApiError", "ChatCompletionRequest", "CompletionRequest", "parse_chat", "parse_completion",
           "plain_message"]

Role = Literal["system", "developer", "user", "assistant", "tool"]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class ApiError(Exception):
    """An error the gateway answers with: its HTTP status and OpenAI's error body."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             410: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
             413: "invalid_request_error", 500: "server_error", 502: "server_error", 503: "server_error",
             504: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def plain_message(e: BaseException, named: bool = False) -> str:
    """An error as one plain line for an agent: a Ray error's cause (not the remote traceback, its pid
    and actor id), without terminal colour codes, bounded; ``named`` puts its type first."""
    while isinstance(getattr(e, "cause", None), BaseException):
        e = e.cause
    text = _ANSI.sub("", str(e))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last)" in text or text.startswith("ray::"):
        lines = lines[-1:]  # a traceback's last line is its error
    text = " ".join(lines)
    return (f"{type(e).__name__}: {text}" if named else text)[:500]


class Function(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=256)]
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, max_length=256)]
    function: Function
    type: Literal["function"] = "function"


class Message(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One chat message. ``content`` is text or OpenAI's list of text parts; images and audio are not
    served (a part of another type is refused by name)."""

    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # what reasoning models' servers return beside the content

    def text(self) -> str:
        """``content`` as one string (text parts joined), or an ApiError naming a part that is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"content part of type {part.get('type')!r} is not supported (text only)",
                               param=f"messages.content[{i}]")
            out.append(part["text"])
        return "".join(out)


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # fields in the order OpenAI's clients send them: the gateway renders the tools as the agent wrote them
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedTool(msgspec.Struct):
    function: dict[str, str]
    type: Literal["function"] = "function"


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


Count = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Stop = str | Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=16)] | None


class _Sampling(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What chat and text completions share. Fields OpenAI defines that the gateway cannot honour are
    kept only to be refused by name (``unsupported``) when set to anything but their no-op value."""

    model: str | None = None  # any name: the episode's engine serves it (GET /models lists it)
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    max_tokens: Count | None = None
    stop: Stop = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1)] = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Names of options set to something the gateway cannot do."""
        out = ["n"] if self.n != 1 else []
        out += [k for k in ("presence_penalty", "frequency_penalty") if getattr(self, k) not in (None, 0, 0.0)]
        out += ["logit_bias"] if self.logit_bias else []
        return out

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """The engine's settings for this call; the episode's cascade still bounds them."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_new_tokens=max_tokens,
                              stop=stop or None, seed=self.seed)


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        if self.response_format not in (None, {"type": "text"}):
            out.append("response_format")
        if self.top_logprobs:
            out.append("top_logprobs")
        if self.store:
            out.append("store")
        return out

    def budget(self) -> int | None:
        """The most tokens this call may generate: ``max_completion_tokens`` (the current name) or the
        older ``max_tokens``; both set and different is refused."""
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; set one", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | Annotated[list[int], Meta(min_length=1)]  # text, or token ids
    logprobs: Annotated[int, Meta(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported()
        out += [k for k in ("echo", "suffix") if getattr(self, k)]
        if self.best_of not in (None, 1):
            out.append("best_of")
        if self.logprobs:  # more than the sampled token's own log-prob: alternatives are not kept
            out.append("logprobs")
        return out


def _parse(body: bytes, type_: Any, route: str) -> Any:
    if not body:
        raise ApiError(400, f"{route}: empty body; send a JSON object")
    try:
        req = decode(body, type_, route)
    except InputError as e:
        raise ApiError(400, str(e), param=(e.path or "").removeprefix("$.") or None,
                       code="invalid_value") from None
    refused = req.unsupported()
    if refused:
        raise ApiError(400, f"{route}: {', '.join(refused)} not supported by the rayapp gateway (an episode is "
                            f"one sampled trajectory; set {'them' if len(refused) > 1 else 'it'} to the default)",
                       param=refused[0], code="unsupported_parameter")
    return req


def parse_chat(body: bytes) -> ChatCompletionRequest:
    """A ``POST /chat/completions`` body, or ApiError(400) naming the field."""
    req = _parse(body, ChatCompletionRequest, "chat/completions")
    req.budget()
    for i, m in enumerate(req.messages):
        m.text()  # a non-text part is refused here, before anything runs
        if m.role == "tool" and not m.tool_call_id:
            raise ApiError(400, f"messages[{i}]: a tool message needs the tool_call_id it answers",
                           param=f"messages[{i}].tool_call_id")
    return req


def parse_completion(body: bytes) -> CompletionRequest:
    """A ``POST /completions`` body, or ApiError(400) naming the field."""
    return _parse(body, CompletionRequest, "completions")
