"""The trainer's prompts as a rayapp step's tasks, for ``RayappRolloutFunc(source, prompts=TrainerPrompts(...))``.

TRL 1.16 hands ``rollout_func(prompts, trainer)`` only the prompt column of its batch, each prompt
repeated ``num_generations`` times in a row; the row's other columns (the answer) stay in the
trainer's batch, and only its reward functions get them. To bring them to rayapp's verifier,
``TrainerPrompts`` takes the trainer's dataset (``rows``): each prompt handed over is looked up among
the rows by its content, and the columns ``fields`` names (label, task type, task id, metadata: a
``FieldMap``, as for a dataset file) make its task. Two rows with one prompt and different columns
are refused when it is built (a prompt handed over could be either). Without ``rows`` a task is the
prompt alone (no label: for a verifier that needs none, or the trainer's own reward functions).

Each run of ``num_generations`` equal prompts is one task of that many samples, in order, so row i
of what the step returns is a completion of ``prompts[i]``: TRL's own reward functions, which get
row i's columns, score the right completion.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from rayapp.core.convert import clip, convert
from rayapp.envs.datasets.files import FieldMap, row_schema, row_task
from rayapp.types import Task, TaskConfig


def _key(prompt: Any, where: str) -> bytes:
    """A prompt's content as bytes, the same for equal prompts (maps in key order)."""
    try:
        return msgspec.json.encode(prompt, order="deterministic")
    except TypeError as e:
        raise ValueError(f"{where}: the prompt is not plain data: {e}") from None


class TrainerPrompts:
    """How ``RayappRolloutFunc`` turns the trainer's prompts into a step's tasks (module docstring):
    ``task_type`` routes them to the evaluator of that id where a row names none."""

    def __init__(self, task_type: str, *, rows: Iterable[Mapping[str, Any]] | None = None,
                 fields: FieldMap | None = None, name: str = "trl"):
        if not isinstance(task_type, str) or not task_type:
            raise ValueError(f"TrainerPrompts: task_type must be a non-empty str, got {task_type!r}")
        self.task_type, self.fields, self.name = task_type, fields or FieldMap(), name
        self.by_prompt: dict[bytes, tuple[int, Task]] = {}
        if rows is None:
            return
        schema = row_schema(self.fields)
        for i, row in enumerate(rows):
            where = f"{name} rows[{i}]"
            task = row_task(convert(row, schema, where), i, name, self.fields, task_type)
            key = _key(task.prompt, where)
            if key not in self.by_prompt:
                self.by_prompt[key] = (i, task)
                continue
            first, other = self.by_prompt[key]
            if msgspec.structs.replace(other, task_id=task.task_id) != task:
                raise ValueError(f"{name} rows[{first}] and rows[{i}] have the same prompt but other columns "
                                 f"(label, task type or metadata): a prompt TRL hands over could be either; make "
                                 f"the prompts unique")
        if not self.by_prompt:
            raise ValueError(f"TrainerPrompts: {name} rows is empty")

    def tasks(self, prompts: list, num_generations: int) -> list[Task]:
        """One task of ``num_generations`` samples per run of equal prompts, in order."""
        g = num_generations
        if not prompts or len(prompts) % g:
            raise ValueError(f"TRL handed {len(prompts)} prompts, not a multiple of num_generations={g}")
        out = []
        for k in range(0, len(prompts), g):
            key = _key(prompts[k], f"TRL's prompt {k}")
            if any(_key(p, f"TRL's prompt {k + j}") != key for j, p in enumerate(prompts[k:k + g])):
                raise ValueError(f"TRL's prompts {k}..{k + g - 1} are not one prompt repeated num_generations={g} "
                                 f"times")
            if self.by_prompt:
                found = self.by_prompt.get(key)
                if found is None:
                    raise ValueError(f"TRL's prompt {k} is in none of the {self.name} rows: "
                                     f"{clip(key.decode(errors='replace'))}")
                task = found[1]
            else:
                task = Task(f"{self.name}-{k // g}", prompts[k], TaskConfig(self.task_type))
            out.append(msgspec.structs.replace(task, config=msgspec.structs.replace(task.config, n_samples=g)))
        return out
