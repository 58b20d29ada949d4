"""The TaskScheduler: drives a rollout step (spec §1-§3). Plain asyncio, no Ray.

Every step makes the same four moves: fetch -> distribute -> batch -> run. ``run_all`` checks
first that the pool can ever admit the largest batch each spec will ask for (fail fast instead of
hanging), then runs the batches concurrently; each batch waits for an all-or-nothing admission,
runs one Evaluator, and gives its tokens back in ``finally``. Results stream out through
``on_task_done`` as each task finishes, and come back whole at the end.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from itertools import chain, zip_longest
from typing import Any, Protocol

import msgspec
from tqdm.auto import tqdm

from rayapp.core.batching import BatchingStrategy, fifo_batching
from rayapp.core.cascade import build_sampling_params, resolve_stopping
from rayapp.core.evaluator import Evaluator, OnTaskDone, TaskRun
from rayapp.core.metrics import eval_metrics, failure_summary
from rayapp.core.pool import budget_tokens
from rayapp.types import Batch, EvaluatorSpec, Resource, Sample, SamplingParams, StoppingCriteria, Task, Token

log = logging.getLogger(__name__)


class DeadlockError(RuntimeError):
    """A spec asks for more placement tokens than the pool can ever provide."""


class Pool(Protocol):
    """What the scheduler needs of a placement pool (the core ledger, or the Ray actor's client).
    ``max_tokens_for`` may be sync or async."""

    async def acquire_batch(self, budget: Resource, per_sample: Resource, max_tokens: int, *,
                            timeout: float | None = None, label: str = "batch") -> list[Token]: ...

    async def release_batch(self, tokens: list[Token]) -> None: ...

    def max_tokens_for(self, per_sample: Resource) -> Any: ...


class DataSource(Protocol):
    def get_tasks(self, n: int) -> Any: ...  # list[Task], or an awaitable of one


class Checkpoint(Protocol):
    """Durable progress of rollout steps (``training.trajectories.RolloutCheckpoint``): the data
    source's state at the fetch and each finished group, so a step cut short resumes where it
    stopped. Blocking I/O: the scheduler calls it from a thread. ``resume`` returns None or an
    object with ``source_state`` and ``groups`` (finished groups by index in fetch order)."""

    def resume(self, rollout_id: int) -> Any: ...

    def begin(self, rollout_id: int, source_state: dict) -> None: ...

    def record_group(self, rollout_id: int, index: int, group: list[Sample]) -> None: ...

    def finish(self, rollout_id: int, next_source_state: dict | None = None) -> None: ...

    def next_source_state(self, rollout_id: int) -> dict | None: ...


class IterationSource(Protocol):
    """Per-iteration state the scheduler publishes (spec §5), e.g. a DAgger schedule. Each call may
    publish environment variables too; the plain dict it returns goes to every agent and back with
    the step's results."""

    def rollout_state(self, rollout_id: int) -> dict[str, Any]: ...

    def eval_state(self, rollout_id: int) -> dict[str, Any]: ...


class RolloutResult(msgspec.Struct):
    rollout_id: int
    groups: list[list[Sample]]  # one group per task, in fetch order
    metrics: dict[str, float] = {}
    iteration: dict[str, Any] = {}  # what the IterationSource published for this step
    artifacts: dict[str, str] = {}  # files the step wrote or read, by kind (set by the host, e.g. the manager)


class EvalResult(msgspec.Struct):
    rollout_id: int
    metrics: dict[str, float]
    samples: dict[str, list[Sample]]  # by dataset name
    iteration: dict[str, Any] = {}
    artifacts: dict[str, str] = {}


async def _resolve(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def interleave(per_dataset: Sequence[Sequence[Task]]) -> list[Task]:
    """Round-robin across datasets: ABCABC..., then the longer ones' rest."""
    return [t for t in chain.from_iterable(zip_longest(*per_dataset)) if t is not None]


class TaskScheduler:
    def __init__(
        self,
        specs: Sequence[EvaluatorSpec] | dict[str, EvaluatorSpec],
        data_source: DataSource | None = None,
        pool: Pool | None = None,
        *,
        batching_strategy: BatchingStrategy | None = None,
        rollout_batch_size: int = 8,
        eval_datasets: dict[str, Sequence[Task]] | None = None,
        n_samples_per_eval_prompt: int = 1,
        global_stopping: StoppingCriteria = StoppingCriteria(),
        global_sampling: SamplingParams = SamplingParams(),
        on_task_done: OnTaskDone | None = None,
        iteration: IterationSource | None = None,
        checkpoint: Checkpoint | None = None,
        acquire_timeout_s: float | None = None,
        progress: bool = True,
        clock: Callable[[], float] = time.time,
    ):
        spec_list = list(specs.values()) if isinstance(specs, dict) else list(specs)
        if not spec_list:
            raise ValueError("TaskScheduler needs at least one EvaluatorSpec")
        self.specs: dict[str, EvaluatorSpec] = {}
        for s in spec_list:
            if s.evaluator_id in self.specs:
                raise ValueError(f"two EvaluatorSpecs share evaluator_id {s.evaluator_id!r}")
            self.specs[s.evaluator_id] = s
        if rollout_batch_size < 1 or n_samples_per_eval_prompt < 1:
            raise ValueError("rollout_batch_size and n_samples_per_eval_prompt must be >= 1")
        self.data_source, self.pool = data_source, pool
        self.batching_strategy = batching_strategy or fifo_batching
        self.rollout_batch_size = rollout_batch_size
        self.eval_datasets = dict(eval_datasets or {})
        self.n_samples_per_eval_prompt = n_samples_per_eval_prompt
        self.global_stopping, self.global_sampling = global_stopping, global_sampling
        self.on_task_done = on_task_done
        self.iteration = iteration
        if checkpoint is not None and not all(hasattr(data_source, m) for m in ("state_dict", "load_state_dict")):
            raise ValueError("a checkpoint needs a data_source with state_dict() and load_state_dict()")
        self.checkpoint = checkpoint
        self.acquire_timeout_s = acquire_timeout_s
        self.progress, self.clock = progress, clock
        self._warned: set[str] = set()
        self._status: dict[str, Any] = {"phase": "idle"}

    # -- the four moves ----------------------------------------------------------------------

    async def execute_rollout(self, rollout_id: int, on_task_done: OnTaskDone | None = None) -> RolloutResult:
        """One rollout step. With a checkpoint, a step that was cut short (the process killed) is
        resumed: the same tasks are fetched again from the saved source state, and only the groups
        not recorded as finished run; ``on_task_done`` fires for those only."""
        if self.data_source is None:
            raise ValueError("execute_rollout needs a data_source")
        # Only the scheduler knows the rollout index: publish the iteration's state before fetching.
        state = self.iteration.rollout_state(rollout_id) if self.iteration else {}
        finished = await self._begin_checkpoint(rollout_id)
        fetched = await _resolve(self.data_source.get_tasks(self.rollout_batch_size))  # fetch
        # Samples are grouped per task object: a task fetched twice gets a group of its own.
        tasks: list[Task] = []
        seen: set[int] = set()
        for t in fetched:
            tasks.append(msgspec.structs.replace(t) if id(t) in seen else t)
            seen.add(id(t))
        groups = self._distribute(rollout_id, tasks)
        self._check_resumed(rollout_id, finished, [groups[id(t)].samples for t in tasks])
        todo = [t for i, t in enumerate(tasks) if i not in finished]
        batches = self.batching_strategy(todo, self.specs)  # batch
        callback = self._recording(rollout_id, tasks, on_task_done or self.on_task_done)
        await self.run_all(rollout_id, batches, groups, callback, phase="rollout", iteration=state)  # run
        samples = [finished[i] if i in finished else groups[id(t)].samples for i, t in enumerate(tasks)]
        metrics = {f"rollout/{k}": float(v) for k, v in failure_summary(chain.from_iterable(samples)).items()}
        if self.checkpoint is not None:
            metrics["rollout/resumed_groups"] = float(len(finished))
            try:
                await asyncio.to_thread(self.checkpoint.finish, rollout_id, self.data_source.state_dict())
            except Exception:  # the step is done: a lost marker costs the next restart its seek, not the samples
                log.exception("rollout %d: could not mark its checkpoint finished", rollout_id)
        return RolloutResult(rollout_id, samples, metrics, state)

    async def _begin_checkpoint(self, rollout_id: int) -> dict[int, list[Sample]]:
        """Resume ``rollout_id`` (its source state back, its finished groups), or begin it where the
        data stream stood after rollout ``rollout_id - 1`` when that one finished here: a restarted
        process, or a trainer that went back to an earlier step, gets the same tasks again."""
        ck = self.checkpoint
        if ck is None:
            return {}
        resumed = await asyncio.to_thread(ck.resume, rollout_id)
        if resumed is not None:
            self.data_source.load_state_dict(resumed.source_state)
            log.warning("rollout %d resumes from its checkpoint: %d groups finished before", rollout_id,
                        len(resumed.groups))
            return dict(resumed.groups)
        before = await asyncio.to_thread(ck.next_source_state, rollout_id - 1) if rollout_id > 0 else None
        if before is not None:
            self.data_source.load_state_dict(before)
        elif rollout_id > 0:
            log.info("rollout %d: no finished checkpoint of rollout %d; the data stream goes on from where the "
                     "source stands", rollout_id, rollout_id - 1)
        await asyncio.to_thread(ck.begin, rollout_id, self.data_source.state_dict())
        return {}

    @staticmethod
    def _check_resumed(rollout_id: int, finished: dict[int, list[Sample]], fetched: list[list[Sample]]) -> None:
        """Restored groups must be the groups of the tasks fetched again: a changed data config (datasets,
        weights, group sizes, batch size) fetches others, and splicing them in would lose and repeat tasks."""
        for i, group in sorted(finished.items()):
            want = (fetched[i][0].task_id, len(fetched[i])) if i < len(fetched) else None
            got = (group[0].task_id, len(group)) if group else (None, 0)
            if got != want:
                raise ValueError(f"rollout {rollout_id}: its checkpoint's group {i} is {got[0]!r} x{got[1]}, but "
                                 f"the fetch from the saved source state gave "
                                 f"{'nothing there' if want is None else f'{want[0]!r} x{want[1]}'}: the data "
                                 f"config changed since the checkpoint was written; restore it, or delete that "
                                 f"rollout's checkpoint to run the step afresh")

    def _recording(self, rollout_id: int, tasks: list[Task], callback: OnTaskDone | None) -> OnTaskDone | None:
        """``callback``, after each finished group is recorded in the checkpoint. A failed write
        costs resumability, not the step: it is logged, and the step goes on."""
        if self.checkpoint is None:
            return callback
        index = {id(t): i for i, t in enumerate(tasks)}

        async def record(task: Task, samples: list[Sample]) -> None:
            try:
                await asyncio.to_thread(self.checkpoint.record_group, rollout_id, index[id(task)], samples)
            except Exception:
                log.exception("rollout %d: could not checkpoint group %d", rollout_id, index[id(task)])
            if callback is not None:
                await _resolve(callback(task, samples))

        return record

    async def execute_eval(self, rollout_id: int, on_task_done: OnTaskDone | None = None) -> EvalResult:
        """Every (prompt x copy) sample, interleaved round-robin across datasets, in one run_all."""
        if not self.eval_datasets:
            raise ValueError("execute_eval needs eval_datasets")
        state = self.iteration.eval_state(rollout_id) if self.iteration else {}
        per_dataset = []
        for name, tasks in self.eval_datasets.items():
            copies = []
            for task in tasks:
                for copy in range(self.n_samples_per_eval_prompt):
                    meta = {**task.metadata, "_eval_dataset_name": name, "_eval_copy": copy}
                    config = msgspec.structs.replace(task.config, n_samples=1)
                    copies.append(msgspec.structs.replace(task, config=config, metadata=meta))
            per_dataset.append(copies)
        tasks = interleave(per_dataset)
        groups = self._distribute(rollout_id, tasks)
        batches = self.batching_strategy(tasks, self.specs)
        await self.run_all(rollout_id, batches, groups, on_task_done, phase="eval", iteration=state)
        by_name: dict[str, list[Sample]] = {name: [] for name in self.eval_datasets}
        for t in tasks:  # split apart by _eval_dataset_name
            by_name[t.metadata["_eval_dataset_name"]].extend(groups[id(t)].samples)
        metrics = eval_metrics(by_name, self.n_samples_per_eval_prompt)
        return EvalResult(rollout_id, metrics, by_name, state)

    def _distribute(self, rollout_id: int, tasks: list[Task]) -> dict[int, TaskRun]:
        """One group of samples per task, with settings resolved now so a bad dataset config
        fails the step before anything runs."""
        groups: dict[int, TaskRun] = {}
        for task in tasks:
            if task.config.n_samples < 1:
                raise ValueError(f"task {task.task_id!r}: n_samples must be >= 1")
            first = task.metadata.get("_eval_copy", 0)
            samples = [
                Sample(task.task_id, first + i, task.prompt, task.label,
                       metadata={**task.metadata, "_rollout_id": rollout_id})
                for i in range(task.config.n_samples)
            ]
            spec = self._resolve_spec_id(task.evaluator_id)
            groups[id(task)] = TaskRun(
                task, samples,
                resolve_stopping(self.global_stopping, spec.default_stopping, samples[0]),
                build_sampling_params(self.global_sampling, spec.default_sampling, samples[0]),
            )
        return groups

    def _resolve_spec_id(self, evaluator_id: str) -> EvaluatorSpec:
        """Exact evaluator_id match, else one warning per unknown id and the first spec."""
        spec = self.specs.get(evaluator_id)
        if spec is None:
            spec = next(iter(self.specs.values()))
            if evaluator_id not in self._warned:
                self._warned.add(evaluator_id)
                log.warning("no EvaluatorSpec %r; falling back to the first spec %r", evaluator_id,
                            spec.evaluator_id)
        return spec

    def _resolve_spec(self, batch: Batch) -> EvaluatorSpec:
        return self._resolve_spec_id(batch.evaluator_id)

    # -- run -----------------------------------------------------------------------------------

    async def _check_deadlock(self, batches: list[Batch]) -> None:
        """Fail fast unless the pool can meet the largest per-spec demand it will ever request."""
        max_batch_samples: dict[str, int] = {}
        for b in batches:
            sid = self._resolve_spec(b).evaluator_id
            max_batch_samples[sid] = max(max_batch_samples.get(sid, 0), b.n_samples)
        for sid, biggest in max_batch_samples.items():
            spec = self.specs[sid]
            budget = budget_tokens(spec.resource, spec.sample_resource)
            if budget < 1:
                raise DeadlockError(f"EvaluatorSpec '{sid}': its resource budget {spec.resource} admits no "
                                    f"sample of {spec.sample_resource}")
            tokens_needed = min(budget, biggest)
            pool_capacity = await _resolve(self.pool.max_tokens_for(spec.sample_resource))
            if pool_capacity < tokens_needed:
                raise DeadlockError(
                    f"Deadlock: EvaluatorSpec '{sid}' needs {tokens_needed} placement tokens but the pool "
                    f"can only provide {pool_capacity} (per-sample resource {spec.sample_resource}); "
                    f"lower its batch_size or resource budget, or grow the cluster layout")

    async def run_all(self, rollout_id: int, batches: list[Batch], groups: dict[int, TaskRun],
                      on_task_done: OnTaskDone | None = None, phase: str = "rollout",
                      iteration: dict[str, Any] | None = None) -> None:
        if self.pool is not None:
            await self._check_deadlock(batches)
        callback = on_task_done or self.on_task_done
        n_tasks = sum(len(b.tasks) for b in batches)
        st = self._status = {"phase": phase, "rollout_id": rollout_id, "batches": len(batches),
                             "batches_waiting": len(batches), "batches_running": 0, "batches_done": 0,
                             "tasks": n_tasks, "tasks_done": 0, "samples_done": 0, "started_at": self.clock()}
        bar = tqdm(total=n_tasks, desc=f"{phase} {rollout_id}", unit="task", disable=not self.progress)

        async def task_done(task: Task, samples: list[Sample]) -> None:
            st["tasks_done"] += 1
            st["samples_done"] += len(samples)
            bar.update(1)
            if callback is not None:
                await _resolve(callback(task, samples))

        try:
            async with asyncio.TaskGroup() as tg:  # one failing batch cancels the rest
                for i, b in enumerate(batches):
                    label = f"{phase}{rollout_id}/b{i}/{b.task_type}"
                    tg.create_task(self._run_batch(rollout_id, b, groups, task_done, label, iteration, phase))
        finally:
            bar.close()
            st["phase"] = f"{phase} done" if st["tasks_done"] == n_tasks else f"{phase} failed"

    async def _run_batch(self, rollout_id: int, batch: Batch, groups: dict[int, TaskRun],
                         task_done: OnTaskDone, label: str, iteration: dict[str, Any] | None,
                         phase: str) -> None:
        spec = self._resolve_spec(batch)
        st = self._status
        tokens: list[Token] | None = None
        if self.pool is not None:
            tokens = await self.pool.acquire_batch(spec.resource, spec.sample_resource, batch.n_samples,
                                                   timeout=self.acquire_timeout_s, label=label)
        st["batches_waiting"] -= 1
        st["batches_running"] += 1
        try:
            evaluator = Evaluator(spec, rollout_id=rollout_id, tokens=tokens, on_task_done=task_done,
                                  clock=self.clock, iteration=iteration, step=phase)
            await evaluator.run([groups[id(t)] for t in batch.tasks])
        finally:
            st["batches_running"] -= 1
            st["batches_done"] += 1
            if tokens is not None:
                await self.pool.release_batch(tokens)

    def status(self) -> dict[str, Any]:
        """Counts of the step in flight (or the last one), for progress displays and the manager."""
        return dict(self._status)
