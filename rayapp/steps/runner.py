"""One training step of a recipe, end to end, in the order the trainer's data depends on (docs/scheduler.md §5).

It exists so the manager only translates calls: a rollout step is a fresh scheduler run (over the
data source's tasks, or exactly the trainer's own, ``rollout(id, tasks)``) or reused trajectories,
then the roll-in metrics, the survivorship filters and the artifacts; an eval step streams its
groups into ``eval_details/``. Invariants: one step runs at a time (weight loads wait their turn
through ``between_steps``); steps are idempotent by id (``results.py``); every result leaves
through ``converters.for_trainer``, where outside code first sees it, while observers, filters and
artifacts see the typed record before it. Nothing here imports Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import msgspec

from rayapp.core.contracts import EvalResult, OnTaskDone, RolloutResult
from rayapp.core.scheduler import TaskScheduler
from rayapp.core.step_metrics import abort_digest
from rayapp.steps.artifacts import EvalDetailsWriter
from rayapp.steps.checkpoint import ResumableRollouts, RolloutCheckpoint
from rayapp.steps.dagger_schedule import roll_in_metrics
from rayapp.steps.filters import AbortCap, Filter, FilterReport, apply_filters
from rayapp.steps.partial import PartialConfig, PartialRollouts
from rayapp.steps.results import StepResults, check_step_id
from rayapp.steps.reuse import ReusePolicy, rollout_or_reuse
from rayapp.trainers.converters import for_trainer
from rayapp.trainers.step_tasks import step_tasks, tasks_digest
from rayapp.types import Sample, Status, StepKind, Task

log = logging.getLogger(__name__)


def filter_step(result: RolloutResult, filters: Sequence[Filter],
                abort_cap: AbortCap | None) -> tuple[RolloutResult, FilterReport | None]:
    """The step with ``filters`` applied in order: the trainer gets the surviving groups; every drop
    is counted by filter and reason in the step's metrics. Also the filters' report (None, and the
    step as it is, when there is neither a filter nor an abort cap)."""
    if not filters and abort_cap is None:
        return result, None
    report = apply_filters(result.groups, list(filters), abort_cap=abort_cap, rollout_id=result.rollout_id)
    metrics = dict(result.metrics)
    for kind, counts in (("dropped", report.dropped), ("dropped_groups", report.dropped_groups)):
        for name, reasons in counts.items():
            metrics |= {f"filter/{name}/{kind}/{reason}": float(n) for reason, n in reasons.items()}
    metrics |= {"filter/input_groups": float(len(result.groups)),
                "filter/input_samples": float(sum(len(g) for g in result.groups)),
                "filter/kept_groups": float(len(report.groups)), "filter/kept_samples": float(report.kept_samples),
                "filter/abort_share": float(report.abort_share),
                "filter/abort_share_exceeded": float(report.abort_share_exceeded)}
    return msgspec.structs.replace(result, groups=report.groups, metrics=metrics), report


def _given(tasks: list[Task]) -> Callable[[], Awaitable[list[Task]]]:
    """A step's fetch that hands it the trainer's tasks (a new list each time: the scheduler owns it)."""
    async def fetch() -> list[Task]:
        return list(tasks)
    return fetch


class StepObserver(Protocol):
    """What watches the steps (a metrics exporter): every finished group's samples as they come,
    and each step's metrics once it ran (not when a finished step is served again)."""

    def samples(self, kind: StepKind, samples: list[Sample]) -> None: ...

    def step(self, kind: StepKind, metrics: dict[str, float]) -> None: ...


def summary_line(kind: StepKind, rollout_id: int, samples: list[Sample], metrics: dict[str, float]) -> str:
    """The one INFO line a step logs: its size, outcomes, mean score and time."""
    aborted = sum(s.status is Status.ABORTED for s in samples)
    scores = [s.reward["score"] for s in samples if s.status is not Status.ABORTED and "score" in s.reward]
    mean = f"{sum(scores) / len(scores):.3f}" if scores else "n/a"
    took, rate = metrics.get(f"{kind}/time/step_s", 0.0), metrics.get(f"{kind}/samples_per_s", 0.0)
    return (f"{kind} {rollout_id}: {len(samples)} samples, {aborted} aborted, mean score {mean}, "
            f"{took:.1f}s ({rate:.2f} samples/s)")


def abort_line(kind: str, rollout_id: int, samples: list[Sample]) -> str | None:
    """The one WARNING line a step with aborts logs: how many, by reason, and the first one's error."""
    digest = abort_digest(samples)
    if digest is None:
        return None
    first, reasons = digest["first"], ", ".join(f"{k} {v}" for k, v in sorted(digest["by_reason"].items()))
    return (f"{kind} {rollout_id}: {digest['n_aborted']} of {len(samples)} samples aborted ({reasons}); the first, "
            f"task {first['task_id']!r} sample {first['index']} in its {first['phase']} phase: {first['error']}")


class StepRunner:
    """The step pipeline around one TaskScheduler (module docstring). ``trajectory_dir`` unset:
    every rollout is fresh and nothing is saved; ``reuse`` unset: the policy with no STACX_* variable set
    (the recipe's wiring hands in the one ``rayapp.recipe.environment`` read)."""

    def __init__(self, scheduler: TaskScheduler, *, filters: Sequence[Filter] = (), abort_cap: AbortCap | None = None,
                 trajectory_dir: str | os.PathLike | None = None, checkpoint: RolloutCheckpoint | None = None,
                 details: EvalDetailsWriter | None = None,
                 release_previous: Callable[[], Awaitable[int]] | None = None, reuse: ReusePolicy | None = None,
                 partial: PartialConfig | None = None):
        self.scheduler, self.filters, self.abort_cap = scheduler, list(filters), abort_cap
        self.trajectory_dir, self.checkpoint, self.details = trajectory_dir, checkpoint, details
        self.release_previous, self.reuse = release_previous, reuse
        # With a checkpoint folder, a rollout cut short resumes where it stopped; with ``partial``,
        # steps are partial rollouts (steps.partial), their carried groups in that folder too.
        self._rollouts: TaskScheduler | PartialRollouts | ResumableRollouts = scheduler
        if partial is not None:
            self._rollouts = PartialRollouts.over(scheduler, partial, checkpoint)
        elif checkpoint is not None:
            self._rollouts = ResumableRollouts.over(scheduler, checkpoint)
        self._lock = asyncio.Lock()
        self.results = StepResults(checkpoint.dir if checkpoint is not None else None)
        self.observers: list[StepObserver] = []

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def status(self) -> dict[str, Any]:
        return {**self.scheduler.status().as_dict(), "busy": self.busy,
                "steps_run": {k.value: n for k, n in self.results.ran.items()},
                "steps_served": {k.value: n for k, n in self.results.served.items()}}

    @contextlib.asynccontextmanager
    async def between_steps(self) -> AsyncIterator[None]:
        """Hold off steps while the body runs (it waits for a running step to finish first)."""
        async with self._lock:
            yield

    async def _begin(self) -> None:
        if self.release_previous is not None:
            freed = await self.release_previous()
            if freed:
                log.warning("freed %d batches left by a previous host of this pool owner", freed)
            self.release_previous = None  # once; a failed release is tried again before the next step

    async def rollout(self, rollout_id: int, tasks: Sequence[Task | Mapping[str, Any]] | None = None) -> RolloutResult:
        """Rollout step ``rollout_id``'s result: run once, then served again (module docstring).
        ``tasks``: the trainer's choice (Tasks, or dicts of a Task's fields), run instead of fetching."""
        if tasks is None:
            return await self.results.once(StepKind.ROLLOUT, rollout_id, self._rollout)
        check_step_id(rollout_id)
        if isinstance(self._rollouts, PartialRollouts):
            raise ValueError(f"rollout {rollout_id}: partial rollouts choose a step's groups themselves (carried "
                             "ones first, more than the step returns), so they cannot run the trainer's tasks; "
                             "turn scheduler.partial off, or pass no tasks")
        chosen = step_tasks(rollout_id, tasks)
        return await self.results.once(StepKind.ROLLOUT, rollout_id, lambda rid: self._rollout(rid, chosen),
                                       digest=tasks_digest(chosen))

    async def evaluate(self, rollout_id: int) -> EvalResult:
        """Eval step ``rollout_id``'s result: run once, then served again (module docstring)."""
        return await self.results.once(StepKind.EVAL, rollout_id, self._evaluate)

    async def _rollout(self, rollout_id: int, chosen: list[Task] | None = None) -> RolloutResult:
        async with self._lock:
            await self._begin()
            ran = await self._run_or_reuse(rollout_id, chosen)
            ran.metrics.update(roll_in_metrics(ran.groups))  # before the filters: every roll-in counts
            result, report = filter_step(ran, self.filters, self.abort_cap)
            self._step_ran(StepKind.ROLLOUT, rollout_id, [s for g in ran.groups for s in g], result.metrics)
            artifacts = dict(result.artifacts)
            folder = self.checkpoint.folder(rollout_id) if self.checkpoint is not None else None
            if folder is not None and folder.exists():  # not when the step was reused
                artifacts["checkpoint"] = str(folder)
            if self.details is not None:  # every sample the step ran, with the final metrics
                path = await asyncio.to_thread(self.details.write_rollout_summary, rollout_id,
                                               msgspec.structs.replace(ran, metrics=result.metrics),
                                               report.summary() if report is not None else None)
                artifacts["train_summary"] = str(path)
                if "reused" not in ran.artifacts:  # a reused step ran nothing now: no timeline of its own
                    artifacts |= await self._timeline("train", rollout_id, [s for g in ran.groups for s in g])
            return for_trainer(msgspec.structs.replace(result, artifacts=artifacts))

    def _observed(self, kind: StepKind, then: OnTaskDone | None = None) -> OnTaskDone | None:
        """The step's group callback: ``then`` (streaming details), then the observers, whose
        failures are logged and never fail the step."""
        if not self.observers:
            return then

        async def done(task: Task, samples: list[Sample]) -> None:
            if then is not None:
                await then(task, samples)
            for o in self.observers:
                try:
                    o.samples(kind, samples)
                except Exception:
                    log.exception("step observer %r failed on a group of %s", o, kind)
        return done

    def _step_ran(self, kind: StepKind, rollout_id: int, samples: list[Sample], metrics: dict[str, float]) -> None:
        log.info("%s", summary_line(kind, rollout_id, samples, metrics))
        aborts = abort_line(kind, rollout_id, samples)
        if aborts is not None:
            log.warning("%s", aborts)
        for o in self.observers:
            try:
                o.step(kind, metrics)
            except Exception:
                log.exception("step observer %r failed on %s %d", o, kind, rollout_id)

    async def _timeline(self, kind: str, rollout_id: int, samples: list[Sample]) -> dict[str, str]:
        """The step's placement timeline files; one that cannot be drawn is logged, never fails the step."""
        try:
            paths = await asyncio.to_thread(self.details.write_timeline, kind, rollout_id, samples)
        except Exception:
            log.exception("%s %d: could not write its placement timeline", kind, rollout_id)
            return {}
        return {k: str(p) for k, p in paths.items()}

    def _running(self, chosen: list[Task] | None) -> dict[str, Any]:
        """What the rollouts below take to run the trainer's tasks: them, and with a checkpoint the
        digest that names them (a step resumes only with the same)."""
        if chosen is None:
            return {}
        digest = {"digest": tasks_digest(chosen)} if isinstance(self._rollouts, ResumableRollouts) else {}
        return {"fetch": _given(chosen), **digest}

    async def _run_or_reuse(self, rollout_id: int, chosen: list[Task] | None) -> RolloutResult:
        """A fresh rollout, or the saved one the reuse policy (docs/scheduler.md §5) points at; the
        trainer's tasks (``chosen``) always run fresh, and a policy that would reuse is refused."""
        given = self._running(chosen)
        if self.trajectory_dir is None:
            return await self._rollouts.execute_rollout(rollout_id, self._observed(StepKind.ROLLOUT), **given)
        ran: list[RolloutResult] = []
        policy = self.reuse or ReusePolicy()
        if chosen is not None and not (decision := policy.decide(rollout_id, self.trajectory_dir)).fresh:
            raise ValueError(f"rollout {rollout_id}: the reuse policy would load {decision.load_path} "
                             f"({decision.mode}) instead of running the trainer's tasks; set "
                             f"STACX_FORCE_FRESH_ROLLOUT=1, or unset scheduler.trajectory_dir")

        async def run() -> list[list[Sample]]:
            ran.append(await self._rollouts.execute_rollout(rollout_id, self._observed(StepKind.ROLLOUT), **given))
            return ran[0].groups

        groups, decision = await rollout_or_reuse(rollout_id, self.trajectory_dir, run, policy)
        if ran:
            saved = {kind.value: str(path) for kind, path in decision.save_paths.items()}
            return msgspec.structs.replace(ran[0], artifacts=saved)
        log.info("rollout %d reuses %s (%s)", rollout_id, decision.load_path, decision.mode)
        return RolloutResult(rollout_id, groups, {"rollout/reused": 1.0}, artifacts={"reused": str(decision.load_path)})

    async def _evaluate(self, rollout_id: int) -> EvalResult:
        async with self._lock:
            await self._begin()
            if self.details is None:
                result = await self.scheduler.execute_eval(rollout_id, self._observed(StepKind.EVAL))
                self._step_ran(StepKind.EVAL, rollout_id, _every(result), result.metrics)
                return for_trainer(result)
            # samples stream into eval_details/{id}.jsonl as they finish (an earlier run's files
            # removed first); the complete files and the summary replace them at the end
            await asyncio.to_thread(self.details.start_eval, rollout_id)
            try:
                result = await self.scheduler.execute_eval(
                    rollout_id, self._observed(StepKind.EVAL, self.details.on_task_done(rollout_id)))
            except BaseException:
                self.details.close_stream(rollout_id)  # here, not in a thread: it must happen if cancelled
                raise
            self._step_ran(StepKind.EVAL, rollout_id, _every(result), result.metrics)
            paths = await asyncio.to_thread(self.details.write_eval, rollout_id, result)
            artifacts = {k: str(p) for k, p in paths.items()}
            artifacts |= await self._timeline(StepKind.EVAL.value, rollout_id, _every(result))
            return for_trainer(msgspec.structs.replace(result, artifacts=artifacts))


def _every(result: EvalResult) -> list[Sample]:
    return [s for samples in result.samples.values() for s in samples]
