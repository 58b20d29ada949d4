"""The reasoning-gym environment family: procedurally generated reasoning tasks (about a hundred
families: arithmetic, logic, graphs, games, ...), each scored by its own dataset's ``score_answer``.

Guarantees:

- ``rows_for(task, size=, seed=, config=)`` are the first ``size`` entries of
  ``reasoning_gym.create_dataset(task, size=, seed=, **config)``, in order: the same arguments give
  the same tasks in any process. A row's prompt is the entry's question; its label names how to
  make the entry again (task, seed, size, config, index) and carries the oracle answer, so labels
  stay small plain JSON whatever a family keeps in its metadata.
- ``verify(sample, result)`` reads the last ``<answer>...</answer>`` of the response (the format
  ``SYSTEM_PROMPT`` asks for) and scores it with the dataset's own ``score_answer`` against the
  entry, made again from the label; the score is that function's, in [0, 1] (some families give
  partial credit). No tagged answer scores 0.0; it never raises on a malformed response.
- ``make_agent(deps)``: a single-turn chat agent with ``SYSTEM_PROMPT``, like the arithmetic env's.
- In a recipe a dataset names its family by import path, ``source: "rayapp.envs.reasoning_gym:tasks.<family>"``
  (``tasks.<family>`` is ``rows(cfg)`` over ``cfg.n_prompts`` and ``cfg.seed`` with the family's
  default config); an unknown family is an ``AttributeError`` listing the known ones.
- reasoning-gym is an optional extra (``pip install 'rayapp[reasoning-gym]'``); this module imports
  without it and says so, naming the extra, when a row or a score is asked for.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from typing import Any

from rayapp.envs.protocol import Env
from rayapp.types import AgentResult, Sample, Task, TaskConfig

TASK_TYPE = "reasoning_gym"
SYSTEM_PROMPT = (
    "Think the problem through step by step, then give only the final answer between <answer> and "
    "</answer>, in the format the question asks for."
)


def _rg() -> Any:
    try:
        import reasoning_gym
    except ModuleNotFoundError as e:
        if e.name != "reasoning_gym":
            raise
        raise ModuleNotFoundError("the reasoning_gym env needs reasoning-gym: pip install 'rayapp[reasoning-gym]'",
                                  name="reasoning_gym") from None
    return reasoning_gym


def families() -> list[str]:
    """The task families reasoning-gym can make."""
    return sorted(_rg().factory.DATASETS)


@functools.lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int, config_json: str) -> Any:
    # Verifying makes the entry again: one dataset object per (family, seed, size, config) per process.
    return _rg().create_dataset(task, size=size, seed=seed, **json.loads(config_json))


def _config_json(config: Mapping[str, Any] | None) -> str:
    try:
        return json.dumps(dict(config or {}), sort_keys=True)
    except TypeError as e:
        raise ValueError(f"reasoning_gym config must be plain JSON data: {e}") from None


def rows_for(task: str, *, size: int, seed: int = 0, config: Mapping[str, Any] | None = None,
             task_type: str = TASK_TYPE, n_samples: int = 1) -> list[Task]:
    """The first ``size`` entries of the ``task`` family as Tasks (see the module docstring)."""
    known = families()
    if task not in known:
        raise ValueError(f"unknown reasoning_gym task {task!r}; known: {known}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"reasoning_gym task {task!r}: size must be an int >= 1, got {size!r}")
    config_json = _config_json(config)
    dataset = _dataset(task, seed, size, config_json)
    rows = []
    for i in range(size):
        entry = dataset[i]
        label = {"task": task, "seed": seed, "size": size, "config": json.loads(config_json), "index": i,
                 "answer": entry["answer"]}
        rows.append(Task(f"rg-{task}-{seed}-{i}", entry["question"], TaskConfig(task_type, n_samples=n_samples),
                         label=label, metadata={"reasoning_gym_task": task}))
    return rows


def extract_answer(text: str | None) -> str | None:
    """The last ``<answer>...</answer>`` of ``text``, stripped; None when there is none."""
    if not text:
        return None
    return _rg().utils.extract_answer(text)


def score(response: str | None, label: Mapping[str, Any]) -> float:
    """The family's own score of ``response`` for the entry ``label`` names."""
    dataset = _dataset(label["task"], label["seed"], label["size"], _config_json(label["config"]))
    try:
        value = float(dataset.score_answer(extract_answer(response), dataset[label["index"]]))
    except Exception:  # a scorer that chokes on a malformed answer: a wrong answer, not a dead episode
        return 0.0
    return min(1.0, max(0.0, value))


def verify(sample: Sample, result: AgentResult) -> dict[str, float]:
    return {"score": score(result.response, sample.label)}


def make_agent(deps: Any) -> Any:
    """A single-turn chat agent; a recipe's verifier (``deps.verify``) wins over this env's."""
    from rayapp.envs.agents.chat import ChatAgent

    return ChatAgent(deps.engine, getattr(deps, "verify", None) or verify, deps.executor,
                     system_prompt=SYSTEM_PROMPT)


def _rows_of(task: str) -> Callable[[Any], list[Task]]:
    def rows(cfg: Any) -> list[Task]:
        return rows_for(task, size=cfg.n_prompts, seed=cfg.seed)

    rows.__name__ = rows.__qualname__ = f"rows_{task}"
    return rows


class _Families:
    """``tasks.<family>``: the rows function of one family, for a recipe's ``source``."""

    def __getattr__(self, task: str) -> Callable[[Any], list[Task]]:
        if task.startswith("__"):  # pickling and introspection look for dunders: not families
            raise AttributeError(task)
        known = families()
        if task not in known:
            raise AttributeError(f"unknown reasoning_gym task {task!r}; known: {known}")
        return _rows_of(task)

    def __dir__(self) -> list[str]:
        return families()


tasks = _Families()


# a recipe names it by path: ``env: rayapp.envs.reasoning_gym:ENV`` (an optional extra, never imported unasked)
ENV = Env(TASK_TYPE, None, make_agent, verify=verify)
