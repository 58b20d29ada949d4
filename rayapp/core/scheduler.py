"""The TaskScheduler: drives a rollout step (docs/scheduler.md §1-§3). Plain asyncio, no Ray.

Every step makes the same four moves: fetch -> distribute -> batch -> run. A step's groups are
indexed by their position in the fetch: results, the progress callback and a step log all speak of
"group i". ``run_all`` checks first that the pool can ever admit the largest batch each spec will ask
for (fail fast instead of hanging), then runs the batches concurrently; each batch waits for an
all-or-nothing admission, runs one Evaluator, and closes its grant in ``finally`` (``release_batch``).
The Evaluator gives each token back as soon as no sample of its batch can use it
(``Pool.release_tokens``), so a later batch may be admitted while an earlier one's slowest samples
still run. The pool is as it was after every step. Results
stream out through ``on_task_done`` as each task finishes, and come back whole at the end. The step
status records how the step ended (done, failed, cancelled), not what its counters suggest.

Time is the running loop's (``core.clock``): timestamps and timeouts agree, real or virtual.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Awaitable, Sequence
from itertools import chain, zip_longest

import msgspec
from tqdm.auto import tqdm

from rayapp.core.batching import BatchingStrategy, fifo_batching
from rayapp.core.cascade import build_sampling_params, resolve_stopping
from rayapp.core.clock import loop_time
from rayapp.core.contracts import (
    DataSource,
    EvalResult,
    Fetch,
    IterationSource,
    OnTaskDone,
    Pool,
    RolloutResult,
    SchedulerConfig,
    StepContext,
    StepLog,
    StepState,
    StepStatus,
    UnfinishedGroup,
    check_protocols,
    identified,
    require_async,
)
from rayapp.core.convert import clip
from rayapp.core.evaluator import Evaluator, GroupDone, TaskRun
from rayapp.core.group_delivery import GroupDelivery
from rayapp.core.pool import budget_tokens
from rayapp.core.stats import sample_statistics, step_times
from rayapp.core.step_metrics import eval_metrics, outcome_metrics
from rayapp.core.uncancellable import run_to_end
from rayapp.record import Iteration
from rayapp.types import (
    Batch,
    BatchRequest,
    EvaluatorSpec,
    Sample,
    SamplingParams,
    StepKind,
    StoppingCriteria,
    Task,
    TaskKey,
    Token,
)

log = logging.getLogger(__name__)
_DATASET_CFG = TaskKey.DATASET_CFG.value

class DeadlockError(RuntimeError):
    """A spec asks for more placement tokens than the pool can ever provide."""


def interleave(per_dataset: Sequence[Sequence[Task]]) -> list[Task]:
    """Round-robin across datasets: ABCABC..., then the longer ones' rest."""
    return [t for t in chain.from_iterable(zip_longest(*per_dataset)) if t is not None]


class TaskScheduler:
    def __init__(
        self,
        specs: Sequence[EvaluatorSpec] | dict[str, EvaluatorSpec],
        data_source: DataSource | None = None,
        pool: Pool | None = None,
        config: SchedulerConfig | None = None,
        *,
        batching_strategy: BatchingStrategy | None = None,
        eval_datasets: dict[str, Sequence[Task]] | None = None,
        on_task_done: OnTaskDone | None = None,
        iteration: IterationSource | None = None,
    ):
        spec_list = list(specs.values()) if isinstance(specs, dict) else list(specs)
        if not spec_list:
            raise ValueError("TaskScheduler needs at least one EvaluatorSpec")
        self.specs: dict[str, EvaluatorSpec] = {}
        for s in spec_list:
            if s.evaluator_id in self.specs:
                raise ValueError(f"two EvaluatorSpecs share evaluator_id {s.evaluator_id!r}")
            self.specs[s.evaluator_id] = s
        config = config or SchedulerConfig()
        if config.rollout_batch_size < 1 or config.n_samples_per_eval_prompt < 1:
            raise ValueError("rollout_batch_size and n_samples_per_eval_prompt must be >= 1")
        check_protocols(data_source, pool, on_task_done, iteration)
        self.data_source, self.pool, self.config = data_source, pool, config
        self.batching_strategy = batching_strategy or fifo_batching
        self.eval_datasets = dict(eval_datasets or {})
        self.on_task_done = on_task_done
        self.iteration = iteration
        self._warned: set[str] = set()
        self._status = StepStatus()

    # -- the four moves ----------------------------------------------------------------------

    async def execute_rollout(self, rollout_id: int, on_task_done: OnTaskDone | None = None, *,
                              fetch: Fetch | None = None, complete_after: int | None = None,
                              step_log: StepLog | None = None) -> RolloutResult:
        """One rollout step (the ``Rollouts`` protocol). Each fetched task starts a group known by its
        ``TaskKey.GROUP_ID`` (``identified``). With a ``step_log`` (a resumable wrapper's), the groups
        it names as finished are not run again (``on_task_done`` does not fire for them) and come back
        in place; every group finished now is handed to it before ``on_task_done``. ``fetch`` gives
        the step's tasks in place of ``rollout_batch_size`` of the data source's.

        ``complete_after=n`` (partial rollouts): the step completes once ``n`` groups are (a step log's finished
        ones count): the batches still running are cancelled, their episodes torn down and their
        tokens back in the pool before it returns; ``groups`` holds the ``n`` complete groups in fetch
        order and ``unfinished`` every other group with its samples as they were left (n=0: nothing
        runs). A group whose last sample ends after the n-th was handed on is unfinished too: no
        group is handed on twice."""
        if fetch is None and self.data_source is None:
            raise ValueError("execute_rollout needs a data_source")
        if complete_after is not None and (type(complete_after) is not int or complete_after < 0):
            raise ValueError(f"complete_after must be an int >= 0, got {complete_after!r}")
        if on_task_done is not None:
            require_async(on_task_done, None, "execute_rollout's on_task_done", "async (task, samples) -> None")
        # Only the scheduler knows the rollout index: publish the iteration's state before fetching.
        state = self.iteration.rollout_state(rollout_id) if self.iteration else Iteration()
        began = loop_time()
        fetched = fetch() if fetch is not None else self.data_source.get_tasks(self.config.rollout_batch_size)
        tasks, fetched_at = identified(rollout_id, list(await fetched)), loop_time()
        groups = self._distribute(rollout_id, tasks)
        finished = dict(await step_log.finished(tasks)) if step_log is not None else {}
        if not set(finished) <= set(range(len(tasks))):
            raise ValueError(f"rollout {rollout_id}: the step log names finished groups "
                             f"{sorted(set(finished) - set(range(len(tasks))))} beyond the {len(tasks)} fetched")
        todo = [i for i in range(len(tasks)) if i not in finished]
        callback = on_task_done or self.on_task_done

        async def hand_on(i: int) -> None:
            if step_log is not None:
                await step_log.group_done(i, groups[i].samples)
            if callback is not None:
                await callback(groups[i].task, groups[i].samples)
            finished[i] = groups[i].samples

        def record(i: int) -> None:  # nothing to hand on: no task per group
            finished[i] = groups[i].samples

        left = None if complete_after is None else complete_after - len(finished)
        if left is None or left > 0:
            step = StepContext(rollout_id, StepKind.ROLLOUT, state, left)
            group_done = record if step_log is None and callback is None else hand_on
            await self.run_all(step, self._batch(tasks, todo), groups, group_done)  # batch, run
        complete = sorted(finished)[:complete_after]  # a step log may name more than asked for
        samples, done = [finished[i] for i in complete], set(complete)
        unfinished = [UnfinishedGroup(i, tasks[i], groups[i].samples if i not in finished else finished[i])
                      for i in range(len(tasks)) if i not in done]
        metrics = outcome_metrics(StepKind.ROLLOUT, chain.from_iterable(samples))
        metrics |= step_times(StepKind.ROLLOUT, sum(map(len, samples)), began, fetched_at)
        return RolloutResult(rollout_id, samples, metrics, state, unfinished=unfinished)

    async def execute_eval(self, rollout_id: int, on_task_done: OnTaskDone | None = None) -> EvalResult:
        """Every (prompt x copy) sample, interleaved round-robin across datasets, in one run_all."""
        if not self.eval_datasets:
            raise ValueError("execute_eval needs eval_datasets")
        state = self.iteration.eval_state(rollout_id) if self.iteration else Iteration()
        began, per_dataset = loop_time(), []
        for name, tasks in self.eval_datasets.items():
            copies = []
            for j, task in enumerate(tasks):
                # The prompt's copies share one group id, which pass@k pools by: two prompts that
                # share a task_id stay two groups.
                group = {TaskKey.EVAL_DATASET_NAME.value: name, TaskKey.GROUP_ID.value: f"{rollout_id}/{name}/{j}"}
                for copy in range(self.config.n_samples_per_eval_prompt):
                    meta = {**task.metadata, **group, TaskKey.EVAL_COPY.value: copy}
                    config = msgspec.structs.replace(task.config, n_samples=1)
                    copies.append(msgspec.structs.replace(task, config=config, metadata=meta))
            per_dataset.append(copies)
        tasks = interleave(per_dataset)
        groups = self._distribute(rollout_id, tasks)
        plan = self._batch(tasks, list(range(len(tasks))))
        callback = on_task_done or self.on_task_done

        async def hand_on(i: int) -> None:
            await callback(groups[i].task, groups[i].samples)

        def nothing(i: int) -> None:
            pass

        await self.run_all(StepContext(rollout_id, StepKind.EVAL, state), plan, groups,
                           hand_on if callback is not None else nothing)
        by_name: dict[str, list[Sample]] = {name: [] for name in self.eval_datasets}
        for g in groups:  # split apart by _eval_dataset_name
            by_name[g.task.metadata[TaskKey.EVAL_DATASET_NAME]].extend(g.samples)
        metrics = eval_metrics(by_name, self.config.n_samples_per_eval_prompt)
        metrics |= step_times(StepKind.EVAL, sum(len(g.samples) for g in groups), began, began)
        metrics |= sample_statistics(StepKind.EVAL, (s for g in groups for s in g.samples))
        return EvalResult(rollout_id, metrics, by_name, state)

    def _distribute(self, rollout_id: int, tasks: list[Task]) -> list[TaskRun]:
        """One group of samples per fetched task, by fetch index, with settings resolved now so a bad
        dataset config fails the step before anything runs."""
        groups: list[TaskRun] = []
        # The cascade once per evaluator id and dataset config object (tasks of one dataset share
        # theirs); the objects outlive the loop, so their ids stay theirs.
        settings: dict[tuple[str, int], tuple[StoppingCriteria, SamplingParams]] = {}
        for task in tasks:
            if task.config.n_samples < 1:
                raise ValueError(f"task {task.task_id!r}: n_samples must be >= 1")
            samples = TaskRun.samples_of(rollout_id, task)
            key = (task.evaluator_id, id(task.metadata.get(_DATASET_CFG)))
            resolved = settings.get(key)
            if resolved is None:
                spec = self._resolve_spec_id(key[0])
                resolved = settings[key] = (
                    resolve_stopping(self.config.global_stopping, spec.default_stopping, samples[0]),
                    build_sampling_params(self.config.global_sampling, spec.default_sampling, samples[0]))
            groups.append(TaskRun(task, samples, *resolved))
        return groups

    def _batch(self, tasks: list[Task], todo: list[int]) -> list[tuple[Batch, list[int]]]:
        """The strategy's batches of the tasks at ``todo``, each with its tasks' fetch indices. The
        strategy sees tasks, not indices: a task object fetched twice maps to its indices in fetch
        order. Batches that do not partition the input (every task once, none foreign), an empty batch
        and a batch mixing evaluators are refused before anything runs."""
        # Each task object's fetch index; the later indices of one fetched twice wait in ``again``.
        first: dict[int, int] = {}
        again: dict[int, deque[int]] = defaultdict(deque)
        for i in todo:
            key = id(tasks[i])
            if key in first:
                again[key].append(i)
            else:
                first[key] = i
        plan = []
        # Keyed as the batches will be run: every evaluator_id the tasks carry, to the spec that runs it.
        specs = {eid: self._resolve_spec_id(eid) for eid in dict.fromkeys(tasks[i].evaluator_id for i in todo)}
        def where() -> str:
            return f"batching strategy {self.batching_strategy!r}: batch {len(plan)}"

        def index_of(task: Task) -> int:
            i = first.pop(id(task), None)
            if i is None:
                queued = again.get(id(task))
                if not queued:
                    raise ValueError(f"{where()} holds a task that is not in its input, or one already batched")
                i = queued.popleft()
            return i

        for b in self._strategy_batches([tasks[i] for i in todo], specs):
            if not isinstance(b, Batch):
                raise ValueError(f"{where()} is a {type(b).__name__}, not a Batch")
            if not b.tasks:
                raise ValueError(f"{where()} is empty")
            if len({t.evaluator_id for t in b.tasks}) > 1:  # one batch runs under one spec's handler and budget
                raise ValueError(f"{where()} mixes evaluators {sorted({t.evaluator_id for t in b.tasks})}")
            plan.append((b, [index_of(t) for t in b.tasks]))
        left = len(first) + sum(map(len, again.values()))
        if left:
            raise ValueError(f"batching strategy {self.batching_strategy!r}: {left} of its tasks are in no batch")
        return plan

    def _strategy_batches(self, tasks: list[Task], specs: dict[str, EvaluatorSpec]) -> list[Batch]:
        """The strategy's answer; one that raises is one error naming it."""
        try:
            return list(self.batching_strategy(tasks, specs))
        except Exception as e:
            raise ValueError(f"batching strategy {self.batching_strategy!r} failed: {type(e).__name__}: "
                             f"{clip(str(e))}") from e

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
            pool_capacity = await self.pool.max_tokens_for(spec.sample_resource)
            if pool_capacity < tokens_needed:
                raise DeadlockError(
                    f"Deadlock: EvaluatorSpec '{sid}' needs {tokens_needed} placement tokens but the pool "
                    f"can only provide {pool_capacity} (per-sample resource {spec.sample_resource}); "
                    f"lower its batch_size or resource budget, or grow the cluster layout")

    async def run_all(self, step: StepContext, plan: list[tuple[Batch, list[int]]], groups: list[TaskRun],
                      group_done: GroupDone) -> None:
        """Run every batch of ``plan`` (batches with their groups' indices); ``group_done(i)`` after
        group ``i`` finished, and what it returns awaited (None: handed on at once). One failing batch
        or callback cancels the rest and fails the step.
        ``step.complete_after=n``: once ``n`` groups were handed on, the batches still running are
        cancelled (the step is done); a group finishing after the n-th began its delivery is not
        handed on, so none is in flight when they are."""
        if self.pool is not None:
            await self._check_deadlock([b for b, _ in plan])
        kind, rollout_id, complete_after = step.kind, step.rollout_id, step.complete_after
        n_tasks = sum(len(indices) for _, indices in plan)
        st = self._status = StepStatus(kind, StepState.RUNNING, rollout_id, batches=len(plan),
                                       batches_waiting=len(plan), tasks=n_tasks, started_at=loop_time())
        bar = tqdm(total=n_tasks, desc=f"{kind.value} {rollout_id}", unit="task", disable=not self.config.progress)

        delivery = GroupDelivery(group_done, groups, st, bar, complete_after)
        try:
            async with asyncio.TaskGroup() as tg:  # one failing batch cancels the rest
                for n, (b, indices) in enumerate(plan):
                    label = f"{kind.value}{rollout_id}/b{n}/{b.task_type}"
                    delivery.batches.append(tg.create_task(self._run_batch(
                        step, st, b, [groups[i] for i in indices], indices, delivery.finished, label)))
        except asyncio.CancelledError:
            st.state = StepState.CANCELLED
            raise
        except BaseException:
            st.state = StepState.FAILED
            raise
        else:
            st.state = StepState.DONE
        finally:
            bar.close()

    async def _run_batch(self, step: StepContext, st: StepStatus, batch: Batch, groups: list[TaskRun],
                         indices: list[int], finished: GroupDone, label: str) -> None:
        """One batch of a step, counted in that step's status ``st`` (steps may run side by side: a stream's)."""
        spec = self._resolve_spec(batch)
        tokens: list[Token] | None = None
        queued = loop_time()
        if self.pool is not None:
            try:
                tokens = await self.pool.acquire_batch(BatchRequest(
                    spec.resource, spec.sample_resource, batch.n_samples, label=label,
                    timeout_s=self.config.acquire_timeout_s))
            except asyncio.CancelledError:  # a step complete without it (complete_after), or cancelled
                st.batches_waiting -= 1
                raise
        st.batches_waiting -= 1
        st.batches_running += 1
        try:
            evaluator = Evaluator(spec, step, tokens=tokens,
                                  release=self.pool.release_tokens if tokens is not None else None,
                                  batch=label, admission=(queued, loop_time()) if tokens is not None else None)

            def done(k: int) -> Awaitable[None] | None:
                return finished(indices[k])

            # A callback that raises cancels the batch's other samples and waits for them, so no
            # episode still holds a token when they go back below.
            await evaluator.run(groups, done)
        finally:
            st.batches_running -= 1
            st.batches_done += 1
            if tokens is not None:  # lands even when the batch is cancelled meanwhile (complete_after, a sibling)
                await run_to_end(self.pool.release_batch(tokens))

    def status(self) -> StepStatus:
        """The step in flight (or the last one), for progress displays and the manager: a copy."""
        return msgspec.structs.replace(self._status)
