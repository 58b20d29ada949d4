"""The command adapter: an agent that is a program (a SWE agent's CLI) run in the sample's sandbox.

``CommandAgent(command)`` has the shape of the async-def adapter's user agent,
``agent(client, task, sandbox)`` (rayapp/gateway/agents.py's ``OpenAIAgent`` opens the episode,
hands it a client pointed at the episode's base URL and key, and closes the episode in ``finally``,
which aborts a call still in flight at the engine). It takes the base URL and key from that client
and runs ``command`` (argv) in the sandbox behind a ``GatewayBridge`` (a local sandbox, here or in
its bundle's actor): the program finds the gateway
at ``OPENAI_BASE_URL`` with ``OPENAI_API_KEY`` and reaches nothing else off its own loopback. Its
environment is the sandbox's scrubbed one plus those two variables; the task is in ``task.json`` in
its working folder (``prompt``, ``label``, ``task_id``, ``index``).

What reaches the verifier (the adapter's ``agent_output``): ``exit_code``, ``stdout``, ``stderr``,
``truncated``, ``duration_s``, and ``files``: each path of ``collect`` read from the working folder
after the program ended (None when absent): the sandbox's state the verifier judges.

Its clock: ``timeout_s`` (never above the sandbox's ``wall_seconds``). Running past it kills the
program, its children and the bridge (the sandbox kills the whole group and PID namespace) and
raises ``AgentTimeout``, which the evaluator classifies; a cancelled episode (the evaluator's
``timeout_s``, a cut group) kills them the same way, before the cancellation goes on.
"""

from __future__ import annotations

import json
from typing import Any

from rayapp.envs.sandboxes.bridge import exec_with_gateway

__all__ = ["CommandAgent"]

TASK_FILE = "task.json"


class CommandAgent:
    """``command``: argv (list of str); ``timeout_s``: its wall clock (None: the sandbox's);
    ``collect``: paths in the working folder handed to the verifier."""

    def __init__(self, command: list[str], *, timeout_s: float | None = None, collect: tuple[str, ...] = ()):
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            raise ValueError(f"command: expected a non-empty list of non-empty strings (argv), got {command!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s: expected > 0 or None, got {timeout_s!r}")
        self.command, self.timeout_s, self.collect = list(command), timeout_s, tuple(collect)

    async def __call__(self, client: Any, task: Any, sandbox: Any) -> dict[str, Any]:
        if sandbox is None:
            raise ValueError("a command agent runs in the sample's sandbox: the evaluator must open one "
                             "(gateway.sandbox: true)")
        task_data = {"task_id": task.task_id, "index": task.index, "prompt": task.prompt, "label": task.label}
        await sandbox.write_file(TASK_FILE, json.dumps(task_data, default=str))
        done = await exec_with_gateway(sandbox, self.command, str(client.base_url), client.api_key,
                                       timeout_s=self.timeout_s, check_timeout=True)
        files: dict[str, str | None] = {}
        for path in self.collect:
            try:
                files[path] = await sandbox.read_file(path)
            except (FileNotFoundError, ValueError):  # absent, or not a plain file of the sandbox user's
                files[path] = None
        return {"exit_code": done.exit_code, "stdout": done.stdout, "stderr": done.stderr,
                "truncated": done.truncated, "duration_s": done.duration_s, "files": files}
