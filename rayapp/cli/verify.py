"""``rayapp verify RECIPE``: a recipe's datasets run through their verifiers, with no model, no Ray and
no engine, so that a verifier is tested before any rollout.

Each row of each dataset (``data`` and ``eval``; one with ``--dataset``) is scored by the verifier its
evaluator will use (the recipe's ``verifier`` plug-in, else its env's own), with the row's reference
answer (its ``label``) as the response, or with the responses of a JSONL file (``--responses``: one
``{"task_id": ..., "response": ...}`` a line; rows without one are skipped). Per dataset it prints the
mean score and how many rows scored above 0. With reference answers, a dataset none of whose rows
scores above 0 has a broken verifier (or labels it cannot read): the exit status is then 1. An env
that verifies inside the episode's sandbox (``humaneval``, ``swe``: its ``Env.verify`` is None and the
recipe names no verifier) cannot be run this way, and is said to be skipped.

Datasets and plug-ins are built as ``rayapp validate`` and the manager build them (``load_recipe``,
``recipe.wiring``), so what is scored here is what a rollout would score.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from rayapp.types import AgentResult, Sample, Task

VERIFY_TIMEOUT_S = 60.0  # one row's verification; past it the row counts as an error


class Response(msgspec.Struct, forbid_unknown_fields=False):
    task_id: str
    response: str
    dataset: str | None = None  # only rows of this dataset, when set


@dataclass
class Report:
    """One dataset's scores."""

    name: str  # "eval/arith-a"
    env: str
    verifier: str  # what scored it (an import path, or "env <name>'s own")
    scores: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    skipped: str | None = None  # why it was not run

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else 0.0

    @property
    def positive(self) -> int:
        return sum(1 for s in self.scores if s > 0)

    def line(self) -> str:
        if self.skipped:
            return f"{self.name:<22} skipped: {self.skipped}"
        n = len(self.scores) + len(self.errors)
        text = (f"{self.name:<22} {n} rows: mean score {self.mean:.3f}, {self.positive} scored > 0 "
                f"(env {self.env}, verifier {self.verifier})")
        if self.errors:
            text += f"; {len(self.errors)} raised, the first: {self.errors[0]}"
        return text


def read_responses(path: str | os.PathLike) -> dict[tuple[str | None, str], str]:
    """The responses of a JSONL file by (dataset or None, task_id); one error naming the line."""
    found: dict[tuple[str | None, str], str] = {}
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = msgspec.json.decode(line, type=Response)
            except msgspec.DecodeError as e:
                raise ValueError(f'responses "{os.fsdecode(path)}": line {i}: {e}') from None
            found[r.dataset, r.task_id] = r.response
    return found


async def _score(fn: Callable, sample: Sample, result: AgentResult) -> float:
    """The verifier's ``score`` for one row (sync verifiers in a worker thread), bounded in time."""
    if inspect.iscoroutinefunction(fn):
        reward = await asyncio.wait_for(fn(sample, result), VERIFY_TIMEOUT_S)
    else:
        reward = await asyncio.wait_for(asyncio.to_thread(fn, sample, result), VERIFY_TIMEOUT_S)
        if inspect.isawaitable(reward):
            reward = await asyncio.wait_for(reward, VERIFY_TIMEOUT_S)
    if not isinstance(reward, Mapping) or "score" not in reward:
        raise TypeError(f"returned {reward!r}, not a dict with a 'score'")
    return float(reward["score"])


async def score_rows(report: Report, fn: Callable, rows: list[tuple[Task, str]]) -> Report:
    for task, response in rows:
        sample = Sample(task.task_id, 0, task.prompt, task.label, metadata=dict(task.metadata))
        result = AgentResult(tokens=[], response_length=0, response=response)
        try:
            report.scores.append(await _score(fn, sample, result))
        except Exception as e:  # a verifier that raises is what this command is for: said, not fatal
            report.errors.append(f"{task.task_id}: {type(e).__name__}: {e}")
    return report


def reference(task: Task) -> str:
    return task.label if isinstance(task.label, str) else json.dumps(task.label)


def _verifier_of(cfg: Any, task_type: str) -> tuple[Any, str, Callable | None]:
    """The evaluator that runs ``task_type``'s rows, and the verifier it will use (None: in its sandbox)."""
    from rayapp.envs.plugin_import import load_verifier
    from rayapp.envs.registry import get_env

    ev = next((e for e in cfg.evaluators if e.evaluator_id == task_type), None)
    if ev is None:
        return None, "", None
    if ev.verifier:
        return ev, ev.verifier, load_verifier(ev.verifier)
    return ev, f"env {ev.env}'s own", get_env(ev.env).verify


def dataset_reports(cfg: Any, only: str | None = None, responses: dict | None = None,
                    limit: int | None = None) -> list[Report]:
    """One Report per dataset of the recipe ``cfg`` (or the one named ``only``: ``math`` or ``eval/math``)."""
    from rayapp.envs.datasets.source import eval_tasks
    from rayapp.recipe.wiring import _dataset

    reports = []
    for where in ("data", "eval"):
        for name, d in sorted(getattr(cfg, where).items()):
            if only is not None and only not in (name, f"{where}/{name}"):
                continue
            n = limit if limit is not None else (d.n_prompts if where == "eval" else None)
            tasks = eval_tasks(_dataset(where, name, d), n)
            by_type: dict[str, list[Task]] = {}
            for t in tasks:
                by_type.setdefault(t.evaluator_id, []).append(t)
            for task_type, rows in by_type.items():
                label = f"{where}/{name}" + (f" ({task_type})" if len(by_type) > 1 else "")
                reports.append(_report(cfg, label, d.env, task_type, rows, name, responses))
    return reports


def _report(cfg: Any, label: str, env: str, task_type: str, rows: list[Task], name: str,
            responses: dict | None) -> Report:
    ev, verifier, fn = _verifier_of(cfg, task_type)
    report = Report(label, ev.env if ev is not None else env, verifier)
    if ev is None:
        report.skipped = f"no evaluator {task_type!r} runs its rows"
        return report
    if fn is None:
        report.skipped = (f"env {ev.env!r} verifies inside the episode's sandbox, with the repository or "
                          "tests there: no plain verify function to call without one")
        return report
    if responses is None:
        pairs = [(t, reference(t)) for t in rows]
    else:
        pairs = [(t, responses.get((name, t.task_id), responses.get((None, t.task_id)))) for t in rows]
        pairs = [(t, r) for t, r in pairs if r is not None]
        if not pairs:
            report.skipped = "no response in the file names one of its rows"
            return report
    return asyncio.run(score_rows(report, fn, pairs))


def verify(recipe: str | os.PathLike, dataset: str | None = None, responses: str | None = None,
           limit: int | None = None) -> int:
    """Print each dataset's scores; 0, or 1 when reference answers score 0 somewhere (a broken verifier),
    2 when the recipe, the dataset name or the responses file is wrong."""
    from rayapp.recipe import RecipeError, load_recipe

    try:
        _, cfg = load_recipe(recipe)
        given = read_responses(responses) if responses is not None else None
    except (RecipeError, ValueError, OSError) as e:
        print(str(e), file=sys.stderr)
        return 2
    reports = dataset_reports(cfg, dataset, given, limit)
    if not reports:
        names = [f"{w}/{n}" for w in ("data", "eval") for n in sorted(getattr(cfg, w))]
        print(f"no dataset {dataset!r} in {os.fsdecode(recipe)}; it has {', '.join(names)}", file=sys.stderr)
        return 2
    what = f"the responses of {Path(responses).name}" if responses else "each row's reference answer (its label)"
    print(f"{os.fsdecode(recipe)}: verifiers scored with {what} as the response")
    broken = []
    for r in reports:
        print("  " + r.line())
        if given is None and not r.skipped and r.positive == 0:
            broken.append(r.name)
    if broken:
        print(f"BROKEN: the reference answers of {', '.join(broken)} score 0: its verifier (or its labels) "
              "cannot be right", file=sys.stderr)
        return 1
    return 0
