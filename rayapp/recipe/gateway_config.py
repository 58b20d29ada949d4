"""An evaluator's ``gateway:`` section: its episodes run an agent written against the OpenAI API, not
rayapp's ``AgentHandler`` (docs/agents.md). The agent is an ``async def`` named by import path; each
episode hands it an ``openai.AsyncOpenAI`` client pointed at the episode's own base URL and key on
the manager's gateway, and what it returns reaches the evaluator's verifier.

The rules checked here are the ones a gateway agent adds to a recipe, each as (JSON path, reason):
the agent resolves and has the right shape; the evaluator does not also name what the gateway agent
replaces (an ``agent`` plug-in, ``tools``, a DAgger ``teacher``); a verifier function scores it (an
env that verifies inside its sandbox has none); and partial rollouts do not ask to resume it: its
state lives in the user's code, where the scheduler cannot keep it, so a cut group can only restart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rayapp.envs import watch
from rayapp.envs.plugin_import import PluginError, load_gateway_agent
from rayapp.envs.registry import get_env
from rayapp.types import MAX_SECONDS

SegmentPolicy = Literal["last", "each"]


class GatewayConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    agent: Annotated[str | None, Meta(description="import path to the agent: async def agent(client: "
                                                  "openai.AsyncOpenAI, task, sandbox) -> what the verifier reads (a "
                                                  "str becomes the result's response); it talks to the model only "
                                                  "through client. Set agent or command")] = None
    command: Annotated[Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None, Meta(
        description="a program run in the sample's local sandbox (argv) with OPENAI_BASE_URL and OPENAI_API_KEY "
                    "set to the episode's: it reaches the gateway and nothing else; its exit code, output and the "
                    "collect files reach the verifier (rayapp/gateway/command.py). Set agent or command")] = None
    command_timeout_s: Annotated[Annotated[float, Meta(gt=0, le=MAX_SECONDS)] | None, Meta(
        description="the command's wall clock, seconds; unset: the sandbox's wall_seconds")] = None
    collect: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(
        description="files of the command's working folder read after it ends, for the verifier")] = []
    segments: Annotated[SegmentPolicy, Meta(
        description="which of an episode's token segments the sample holds: last (the segment of the last call) "
                    "or each (the last one, the earlier ones kept in the sample's metadata under "
                    "gateway_segments); a new segment starts where the agent's history cannot be extended "
                    "(docs/agents.md)")] = "last"
    sandbox: Annotated[bool, Meta(description="open the evaluator's sandbox for each episode and hand it to the "
                                              "agent as its third argument; false: the agent gets None")] = False
    tool_parser: Annotated[str, Meta(
        pattern=r"^(transformers|sglang:[A-Za-z0-9_.-]+)$",
        description="how a reply's tool calls are read: transformers (the tokenizer's response template, else "
                    "the Hermes format) or sglang:<name>, SGLang's own parser of that name as its server's "
                    "--tool-call-parser (qwen25, llama3, hermes, ...; sglang where the manager runs, checked "
                    "when it starts)")] = "transformers"


def check_gateways(recipe: Any) -> Iterator[tuple[str, str]]:
    """Each evaluator with a ``gateway`` section fits (module docstring), first problem first."""
    partial = recipe.scheduler.partial
    for i, ev in enumerate(recipe.evaluators):
        if ev.gateway is None:
            continue
        at = f"$.evaluators[{i}]"
        yield from _check_agent(at, ev)
        for key, what in (("agent", "an agent plug-in"), ("tools", "tools (the gateway agent offers its own in "
                                                                   "its requests)"),
                          ("teacher", "a DAgger teacher (the gateway agent's turns are its own)")):
            if getattr(ev, key) is not None:
                yield f"{at}.{key}", f"an evaluator with a gateway agent ({at}.gateway.agent) takes no {what}: " \
                                     f"unset {key}"
        if ev.verifier is None:
            try:
                env_verifies = get_env(ev.env).verify is not None
            except PluginError:
                env_verifies = True  # the env's own error is reported at its field
            if not env_verifies:
                yield f"{at}.verifier", (f"env {ev.env!r} verifies inside its own agent's sandbox, which a gateway "
                                         f"agent does not run: name a verifier function, verify(sample, result)")
        if partial is not None and partial.policy == "resume":
            yield "$.scheduler.partial.policy", (
                f"resume cannot go on with the gateway agent of {at}.gateway.agent: its state lives in its own "
                f"code, so a cut group restarts; set $.scheduler.partial.policy to restart")


def _check_agent(at: str, ev: Any) -> Iterator[tuple[str, str]]:
    """One of an async def and a command, with what each needs."""
    gw = ev.gateway
    if (gw.agent is None) == (gw.command is None):
        yield f"{at}.gateway", "set one of agent (an async def by import path) and command (a program's argv)"
    elif gw.command is not None:
        if not gw.sandbox:
            yield f"{at}.gateway.sandbox", "a gateway command runs in the sample's sandbox: set sandbox: true"
    else:
        try:
            with watch.field(f"{at}.gateway.agent"):
                load_gateway_agent(gw.agent)
        except PluginError as e:
            yield f"{at}.gateway.agent", str(e)
    if gw.command is None and (gw.command_timeout_s is not None or gw.collect):
        yield f"{at}.gateway", "command_timeout_s and collect are a command's settings: unset them, or set command"
