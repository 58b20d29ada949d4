"""Tasks a trainer chooses for a rollout step (``StepRunner.rollout(rollout_id, tasks)``), for the
trainers that keep their own dataloader (TRL, verl).

- ``step_tasks`` takes the trainer's list as it comes: each item a ``Task`` or a dict of a Task's
  fields, put through the one door (``core.convert``) so that a bad one is one ``InputError`` naming
  the step, the item's index and the field (``rollout 3: tasks[1]: $.config.task_type: missing
  required field``) and nothing runs. A task is plain data (it is saved with the step's result), so
  a value msgpack cannot hold (an array object in ``label``) is refused the same way. The fields
  partial rollouts set on their own tasks (``Task.carried``, ``metadata["_group_id"]``) are refused:
  group ``i`` of such a step is always ``"<rollout_id>/<i>"`` (``TaskKey.GROUP_ID`` on its samples),
  so a trainer can tell which of its tasks a group is, also after a filter dropped some.
- ``tasks_digest`` names a list of tasks: a sha256 of their msgpack with maps in key order, so the
  same tasks give the same digest in any process. A step's durable record keeps it (its stored result,
  its mid-rollout checkpoint): the same id asked for with other tasks is refused, not served.
- ``tasks_from_rows`` builds Tasks from a trainer's rows (dicts with the dataloader's columns): which
  column is the prompt, the label, the task type (routing to the evaluator of that id), the task id
  and the metadata is a ``FieldMap``, as for a dataset file; other columns are ignored.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from rayapp.core.convert import InputError, convert
from rayapp.envs.datasets.files import FieldMap, row_schema, row_task
from rayapp.types import Task, TaskConfig, TaskKey

_RESERVED = TaskKey.GROUP_ID.value


def _plain(item: Any, source: str) -> Any:
    """``item`` as plain data, or one InputError naming the first field that is not plain data."""
    try:
        return msgspec.to_builtins(item)
    except TypeError as e:
        fields = (msgspec.structs.asdict(item) if isinstance(item, msgspec.Struct)
                  else item if isinstance(item, Mapping) else {})
        for name, value in fields.items():
            try:
                msgspec.to_builtins(value)
            except TypeError:
                raise InputError(source, f"$.{name}", f"not plain data: {e}") from None
        raise InputError(source, "$", f"not plain data: {e}") from None


def step_tasks(rollout_id: int, tasks: Any) -> list[Task]:
    """The trainer's ``tasks`` for rollout ``rollout_id``, checked (module docstring): a new list of
    new Tasks, so that nothing the caller does to its own objects later reaches the step."""
    if isinstance(tasks, str | bytes | Mapping) or not isinstance(tasks, Sequence):
        raise TypeError(f"rollout {rollout_id}: tasks must be a list of Task or dicts of a Task's fields, "
                        f"got {type(tasks).__name__}")
    if not tasks:
        raise ValueError(f"rollout {rollout_id}: tasks is empty; pass None to let the data source choose")
    out = []
    for i, item in enumerate(tasks):
        source = f"rollout {rollout_id}: tasks[{i}]"
        if not isinstance(item, Task | Mapping):
            raise InputError(source, "$", f"expected a Task or a dict of its fields, got {type(item).__name__}")
        task = convert(_plain(item, source), Task, source)
        if task.carried is not None:
            raise InputError(source, "$.carried", "set by partial rollouts only; leave it unset")
        if _RESERVED in task.metadata:
            raise InputError(source, f"$.metadata.{_RESERVED}", f"the step names its groups itself "
                                                                f"('{rollout_id}/{i}'); leave it unset")
        out.append(task)
    return out


def tasks_digest(tasks: list[Task]) -> str:
    """A name for ``tasks`` that any process computes alike (module docstring)."""
    return hashlib.sha256(msgspec.msgpack.encode(tasks, order="deterministic")).hexdigest()


def tasks_named(digest: str | None) -> str:
    """The tasks a step's record names, for errors: the data source's (None), or the trainer's."""
    return "the data source's tasks" if digest is None else f"trainer-chosen tasks (digest {digest[:12]})"


def tasks_from_rows(rows: Sequence[Mapping[str, Any]], *, task_type: str, n_samples: int = 1,
                    fields: FieldMap | None = None, name: str = "trainer") -> list[Task]:
    """One Task per row, in order: the columns ``fields`` names (``FieldMap``: prompt, label, task
    type, task id, metadata columns), ``task_type`` where the row names none, ``n_samples`` samples
    each (the group size: TRL's ``num_generations``, verl's ``rollout.n``); without a task id column
    a task's id is ``<name>-<index>``. A bad row is one InputError naming it and its column
    (``trainer rows[2]: $.question: missing required field``)."""
    if not isinstance(task_type, str) or not task_type:
        raise ValueError(f"tasks_from_rows: task_type must be a non-empty str, got {task_type!r}")
    if type(n_samples) is not int or n_samples < 1:
        raise ValueError(f"tasks_from_rows: n_samples must be an int >= 1, got {n_samples!r}")
    fields = fields or FieldMap()
    schema = row_schema(fields)
    out = []
    for i, row in enumerate(rows):
        task = row_task(convert(row, schema, f"{name} rows[{i}]"), i, name, fields, task_type)
        out.append(msgspec.structs.replace(task, config=TaskConfig(task.config.task_type, n_samples=n_samples)))
    return out
