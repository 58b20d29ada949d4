"""The mini-SWE environment: small repositories with one failing test each, fixed by an agent
with bash/read_file/write_file tools in a sandbox holding the repository, and its DAgger variant
(``ENV``, what recipes name ``swe``).

It exists as a small, offline, real coding task: the agent reads the issue, edits files and runs
commands in a sandbox, and the repository's own test suite is the verifier. Invariants: every
``task.json`` is validated before anything is returned (one ``DatasetError`` naming the file and
field); the agent never sees ``task.json`` (the gold patch); the shipped tests are restored before
verifying, so an edited test cannot pass; a failing run scores 0.0, never an exception.
Details: docs/plugins.md, "The built-in environments and agents".
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path, PurePosixPath
from typing import Annotated, Any

import msgspec

from rayapp.core.convert import decode
from rayapp.core.termination import SandboxError
from rayapp.envs.agents.dagger import DAggerRollIn
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.agents.tools import bash, read_file, write_file
from rayapp.envs.datasets.rows import DatasetError
from rayapp.envs.protocol import AgentDeps, Env
from rayapp.envs.sandboxes.base import Sandbox
from rayapp.episode import EpisodeContext
from rayapp.types import AgentResult, Sample, Task, TaskConfig

REPOS_DIR = Path(__file__).resolve().parent / "datasets" / "swe_repos"  # package data (pyproject)
TASK_FILE = "task.json"
TEST_DIRS = ("tests",)  # the folders that hold a repository's tests; verify_swe restores them
_SKIP_DIRS = {"__pycache__", ".git", ".pytest_cache"}
_SKIP_FILES = {TASK_FILE}

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
TestId = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")]


class SweTaskFile(msgspec.Struct, forbid_unknown_fields=True):
    """One ``task.json``."""

    id: NonEmpty
    issue: NonEmpty
    test_command: NonEmpty
    failing_test: TestId  # unittest id: package.module.Class.test_method
    gold_patch: Annotated[dict[NonEmpty, str], msgspec.Meta(min_length=1)]  # path -> fixed content


class SweRepo(msgspec.Struct, frozen=True):
    name: str
    task: SweTaskFile
    files: dict[str, str]  # relative posix path -> content, task.json excluded


# ---------------------------------------------------------------------------------------------- loading


def _repo_files(folder: Path) -> dict[str, str]:
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder)
        if (not path.is_file() or _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.as_posix() in _SKIP_FILES
                or path.suffix == ".pyc"):
            continue
        files[rel.as_posix()] = path.read_text(encoding="utf-8")
    return files


def _check_task(task: SweTaskFile, files: dict[str, str]) -> tuple[str, str] | None:
    """(JSON path, problem) for what msgspec's schema cannot say, or None."""
    for path in task.gold_patch:
        pure = PurePosixPath(path)
        if pure.is_absolute() or ".." in pure.parts or path != pure.as_posix():
            return f"$.gold_patch.{path}", "must be a normalised relative path inside the repository"
        if path in _SKIP_FILES or pure.parts[0] in TEST_DIRS:
            return f"$.gold_patch.{path}", "a fix may not touch the tests or task.json"
    module = task.failing_test.split(".")
    # The test module is some dotted prefix of the id (the rest is Class.method).
    if not any("/".join(module[:k]) + ".py" in files for k in range(1, len(module))):
        return "$.failing_test", f"no test module in the repository for {task.failing_test!r}"
    return None


def load_repo(name: str, root: str | Path | None = None) -> SweRepo:
    """One repository, its ``task.json`` validated; ``DatasetError`` names the repo, file and field."""
    folder = Path(root or REPOS_DIR) / name
    task_path = folder / TASK_FILE
    where = f"swe repo {name!r} ({str(task_path)!r})"
    try:
        raw = task_path.read_bytes()
        files = _repo_files(folder)
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(where, None, f"cannot read: {e}") from None
    task = decode(raw, SweTaskFile, where, error=DatasetError)
    problem = _check_task(task, files)
    if problem is not None:
        raise DatasetError(where, *problem)
    return SweRepo(name, task, files)


def repo_names(root: str | Path | None = None) -> list[str]:
    """The repositories under ``root`` (every folder holding a task.json), sorted."""
    folder = Path(root or REPOS_DIR)
    return sorted(p.parent.name for p in folder.glob(f"*/{TASK_FILE}"))


def load_repos(root: str | Path | None = None) -> list[SweRepo]:
    names = repo_names(root)
    if not names:
        raise DatasetError("swe", None, f"no repositories (no */{TASK_FILE}) under {str(root or REPOS_DIR)!r}")
    repos = [load_repo(n, root) for n in names]
    seen: dict[str, str] = {}
    for r in repos:
        if r.task.id in seen:
            raise DatasetError(f"swe repo {r.name!r} ({str(Path(root or REPOS_DIR) / r.name / TASK_FILE)!r})",
                               "$.id", f"duplicate value {r.task.id!r} (also in repo {seen[r.task.id]!r})")
        seen[r.task.id] = r.name
    return repos


def build_prompt(repo: SweRepo) -> str:
    layout = "\n".join(f"  {p}" for p in repo.files)
    return (
        "You are working in a small Python repository; it is your current folder. A user reported this "
        f"issue:\n\n<issue>\n{repo.task.issue}\n</issue>\n\n"
        f"Repository layout:\n{layout}\n\n"
        "Find the cause and fix it in the source code; do not change the tests. Tools (paths are relative "
        "to the repository):\n"
        f"- bash {{\"command\": ...}} runs a shell command there; run the tests with `{repo.task.test_command}`;\n"
        "- read_file {\"path\": ...} shows a file;\n"
        "- write_file {\"path\": ..., \"content\": ...} replaces a file's whole content.\n"
        "When the tests pass, reply with a one-line summary of the fix and no tool call."
    )


def repo_task(repo: SweRepo, task_type: str = "swe", n_samples: int = 1, task_id: str | None = None) -> Task:
    label = {"repo": repo.name, "test_command": repo.task.test_command, "failing_test": repo.task.failing_test}
    return Task(task_id or repo.task.id, build_prompt(repo), TaskConfig(task_type, n_samples=n_samples),
                label=label, metadata={"repo": repo.name, "swe_id": repo.task.id})


def load_swe_tasks(task_type: str = "swe", n_samples: int = 1, *, root: str | Path | None = None) -> list[Task]:
    """One task per repository, in name order, ids from task.json."""
    return [repo_task(r, task_type, n_samples) for r in load_repos(root)]


# ---------------------------------------------------------------------------------------------- sandbox side

_IO_TIMEOUT_S = 30.0  # per file write: only guards against a sandbox that hangs


async def _write(sandbox: Sandbox, path: str, content: str) -> None:
    try:
        await asyncio.wait_for(sandbox.write_file(path, content), timeout=_IO_TIMEOUT_S)
    except TimeoutError as e:
        raise SandboxError(f"sandbox did not write {path!r} within {_IO_TIMEOUT_S:g}s") from e


async def prepare_repo(sandbox: Sandbox, repo_name: str, *, root: str | Path | None = None) -> list[str]:
    """Write the repository's files (never task.json) into the sandbox's folder; the paths written."""
    repo = _known_repo(repo_name, root)
    for path, content in repo.files.items():
        await _write(sandbox, path, content)
    return list(repo.files)


def _known_repo(repo_name: Any, root: str | Path | None) -> SweRepo:
    names = repo_names(root)
    if repo_name not in names:  # also keeps a label from naming a path outside the data folder
        raise ValueError(f"unknown swe repo {repo_name!r}; known: {names}")
    return load_repo(repo_name, root)


class UnittestReport(msgspec.Struct, frozen=True):
    """What unittest's text output says. ``ran`` is None when no summary was printed (a crash)."""

    ran: int | None = None
    ok: bool = False
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    expected_failures: int = 0
    unexpected_successes: int = 0
    failed_ids: tuple[str, ...] = ()  # FAIL/ERROR tests as unittest ids, in output order

    @property
    def failed(self) -> int:
        return self.failures + self.errors + self.unexpected_successes

    @property
    def passed(self) -> int:
        if self.ran is None:
            return 0
        return max(0, self.ran - self.failed - self.skipped - self.expected_failures)


_RAN = re.compile(r"^Ran (\d+) tests? in [\d.]+s\s*\n\s*\n?(OK|FAILED|NO TESTS RAN)(?: \(([^)]*)\))?\s*$", re.M)
_FAILED_TEST = re.compile(r"^(?:FAIL|ERROR|UNEXPECTED SUCCESS): (\S+) \(([\w.]+)\)", re.M)
_COUNT_KEYS = {"failures": "failures", "errors": "errors", "skipped": "skipped",
               "expected failures": "expected_failures", "unexpected successes": "unexpected_successes"}


def parse_unittest(output: str) -> UnittestReport:
    """Read unittest's summary (the last one printed) and the ids of the tests that failed."""
    summaries = list(_RAN.finditer(output))
    if not summaries:
        return UnittestReport()
    last = summaries[-1]
    counts: dict[str, int] = {}
    for part in (last.group(3) or "").split(","):
        key, _, value = part.strip().rpartition("=")
        if key in _COUNT_KEYS and value.isdigit():
            counts[_COUNT_KEYS[key]] = int(value)
    ids = []
    for m in _FAILED_TEST.finditer(output[: last.start()]):
        name, where = m.groups()
        # Python >= 3.11 prints "test (pkg.mod.Class.test)", older ones "test (pkg.mod.Class)".
        ids.append(where if where.endswith(f".{name}") else f"{where}.{name}")
    return UnittestReport(ran=int(last.group(1)), ok=last.group(2) == "OK", failed_ids=tuple(ids), **counts)


async def restore_tests(sandbox: Sandbox, repo_name: str, *, root: str | Path | None = None) -> bool:
    """Put the shipped test folders back exactly, removing whatever else is in them. False when
    something the agent left blocks it (a folder it cannot delete, a symlink in the way): that is
    the agent's outcome. A sandbox fault raises ``SandboxError``."""
    repo = _known_repo(repo_name, root)
    res = await sandbox.exec(["rm", "-rf", "--", *TEST_DIRS], timeout_s=_IO_TIMEOUT_S)
    if not res.ok:
        return False
    try:
        for path, content in repo.files.items():
            if PurePosixPath(path).parts[0] in TEST_DIRS:
                await _write(sandbox, path, content)
    except (OSError, ValueError):  # SandboxError is neither: it propagates
        return False
    return True


async def verify_swe(sandbox: Sandbox, label: dict[str, Any], *, timeout_s: float = 60.0,
                     root: str | Path | None = None, restore: bool = True) -> dict[str, float]:
    """Run the repository's tests in ``sandbox``: {"score", "tests_passed", "tests_failed"}.

    ``label`` is the task's label ({"repo", "test_command", ...}). The test command runs under the
    sandbox's own wall clock (at most ``timeout_s``); the outer bound only catches a hung sandbox."""
    if not isinstance(label, dict) or "repo" not in label:
        raise ValueError(f"swe label must be a dict with a 'repo', got {label!r}")
    repo = _known_repo(label["repo"], root)
    command = str(label.get("test_command") or repo.task.test_command)
    if restore and not await restore_tests(sandbox, repo.name, root=root):
        return {"score": 0.0, "tests_passed": 0.0, "tests_failed": 0.0}
    try:
        res = await asyncio.wait_for(sandbox.exec(command, timeout_s=timeout_s), timeout=timeout_s + _IO_TIMEOUT_S)
    except TimeoutError as e:
        raise SandboxError(f"sandbox did not return from the test command within {timeout_s + _IO_TIMEOUT_S:g}s") from e
    # unittest writes its report to stderr (stdout only when the command redirects it there).
    report = parse_unittest(res.stderr)
    if report.ran is None:
        report = parse_unittest(res.stdout)
    passed = res.ok and report.ok and bool(report.ran)
    return {"score": float(passed), "tests_passed": float(report.passed), "tests_failed": float(report.failed)}


# ---------------------------------------------------------------------------------------------- environment

TOOLS = {"bash": bash, "read_file": read_file, "write_file": write_file}


class SweAgent(ToolAgent):
    """Works in a sandbox holding the repository; the same sandbox is verified after the episode."""

    def __init__(self, deps: AgentDeps):
        async def sandbox_for(sample: Sample, ctx: EpisodeContext) -> Any:
            sandbox = await deps.open_sandbox(ctx.token)
            try:
                await prepare_repo(sandbox, sample.label["repo"])
            except BaseException:
                await sandbox.close()
                raise
            return sandbox

        super().__init__(deps.engine, verify=None, tools=TOOLS if deps.tools is None else deps.tools,
                         executor=deps.executor, sandbox_factory=sandbox_for, keep_sandbox=True)

    async def verify_in(self, sandbox: Any, sample: Sample, result: AgentResult) -> dict[str, float]:
        return await verify_swe(sandbox, sample.label)


class DAggerSweAgent(DAggerRollIn, SweAgent):
    """mini-SWE with the DAgger roll-in: student and teacher act in the same sandbox."""

    def __init__(self, deps: AgentDeps, seed: int = 0):
        if deps.teacher is None:
            raise ValueError("DAggerSweAgent needs a teacher engine")
        super().__init__(deps)
        self.teacher, self.seed = deps.teacher, seed


def rows(cfg) -> list[Task]:
    return load_swe_tasks()


ENV = Env("swe", rows, SweAgent, DAggerSweAgent, tools=TOOLS)
