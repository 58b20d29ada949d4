"""Batch composition: the scheduler's one pluggable decision (docs/scheduler.md §2).

A strategy is any callable ``(tasks, specs) -> batches``; everything downstream is uniform. Every
strategy keeps two invariants the scheduler checks before anything runs: each task lands in exactly
one batch, and a batch holds tasks of one evaluator only (``Task.evaluator_id``, which defaults to
the task_type). ``specs`` is keyed by evaluator_id, the spec that will run the task: the scheduler
hands every id its tasks carry, an unknown one mapped to its fallback spec, so a strategy sizes a
batch by the very spec that runs it.
"""

from __future__ import annotations

from collections.abc import Callable

from rayapp.core.pool import budget_tokens
from rayapp.types import Batch, EvaluatorSpec, Task

BatchingStrategy = Callable[[list[Task], dict[str, EvaluatorSpec]], list[Batch]]


def fifo_batching(tasks: list[Task], specs: dict[str, EvaluatorSpec]) -> list[Batch]:
    """Group by evaluator in encounter order, sealing a batch at its spec's batch_size."""
    batches: list[Batch] = []
    open_batch: dict[str, Batch] = {}
    for task in tasks:
        eid = task.evaluator_id
        batch_size = specs[eid].batch_size if eid in specs else None
        if eid not in open_batch:  # start a batch for this evaluator
            b = Batch(task_type=task.config.task_type)
            open_batch[eid] = b
            batches.append(b)
        open_batch[eid].tasks.append(task)
        if batch_size is not None and len(open_batch[eid].tasks) >= batch_size:
            del open_batch[eid]  # seal -> the next task of this evaluator opens a new one
    return batches


def longest_first_batching(tasks: list[Task], specs: dict[str, EvaluatorSpec]) -> list[Batch]:
    """fifo_batching over the tasks sorted by ``config.expected_len``, longest first.

    Long episodes start in the first batches, so the step's tail is made of short ones instead of
    one straggler that every other batch waits on. Tasks without an estimate keep their order
    after the estimated ones (the sort is stable).
    """
    ordered = sorted(tasks, key=lambda t: -(t.config.expected_len or 0.0))
    return fifo_batching(ordered, specs)


def budget_batching(tasks: list[Task], specs: dict[str, EvaluatorSpec]) -> list[Batch]:
    """Pack each batch to what its spec's resource budget admits at once.

    A batch is sealed when the next task's samples would exceed the tokens the budget grants
    (``budget_tokens(spec.resource, spec.sample_resource)``), or at batch_size if that comes
    first. Every batch then runs in one wave: no sample waits inside an admitted batch for a token
    while it holds the batch's whole reservation. A task larger than the budget gets a batch of
    its own (its group must stay together).
    """
    batches: list[Batch] = []
    open_batch: dict[str, Batch] = {}
    for task in tasks:
        eid = task.evaluator_id
        spec = specs.get(eid)
        cap = budget_tokens(spec.resource, spec.sample_resource) if spec else None
        size = spec.batch_size if spec else None
        b = open_batch.get(eid)
        if b is not None and cap is not None and b.n_samples + task.config.n_samples > cap:
            b = None  # the budget is full: seal and open a new one
        if b is None:
            b = open_batch[eid] = Batch(task_type=task.config.task_type)
            batches.append(b)
        b.tasks.append(task)
        if size is not None and len(b.tasks) >= size:
            del open_batch[eid]
    return batches


STRATEGIES: dict[str, BatchingStrategy] = {
    "fifo": fifo_batching,
    "longest_first": longest_first_batching,
    "budget": budget_batching,
}
