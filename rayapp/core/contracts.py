"""What the scheduler takes and gives: what a step takes (the protocols of its data source, pool, step log and
iteration source; its settings) and what it gives (results, and the status of the step in flight).
They live apart from ``core.scheduler`` so that a host, a wrapper or a test can speak of them
without the scheduler itself.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Protocol, runtime_checkable

import msgspec
from msgspec import Meta

from rayapp.record import Iteration
from rayapp.types import (
    MAX_SECONDS,
    MAX_STEP_SAMPLES,
    BatchRequest,
    Resource,
    Sample,
    SamplingParams,
    StepKind,
    StoppingCriteria,
    Task,
    TaskKey,
    Token,
)

OnTaskDone = Callable[[Task, list[Sample]], Awaitable[None]]
Fetch = Callable[[], Awaitable[list[Task]]]  # a step's tasks in fetch order, in place of the data source's
# After a step ran: what it leaves to the next one (partial rollouts' carried groups), which a
# resumable wrapper saves with the step's end
Carry = Callable[["RolloutResult"], list[Any]]


def require_async(obj: Any, method: str | None, what: str, protocol: str) -> None:
    """``obj.method`` (``obj`` itself when ``method`` is None) is a coroutine function, else one
    TypeError naming the object, the method and what it must be. Checked where a plug-in is handed
    in: a plain ``def`` would otherwise fail deep inside a step ("object list can't be used in
    'await' expression")."""
    fn = obj if method is None else getattr(obj, method, None)
    call = getattr(fn, "__call__", None)  # noqa: B004 -- an object with an async __call__ is a coroutine function too
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
        return
    name = type(obj).__name__ if method is not None else getattr(obj, "__qualname__", type(obj).__name__)
    where = f"{what} {name}" + (f".{method}" if method else "")
    found = "missing" if fn is None else ("not callable" if not callable(fn) else "a plain function")
    raise TypeError(f"{where}: {found}; it must be a coroutine function: {protocol}")


class Pool(Protocol):
    """What the scheduler needs of a placement pool (the core ledger, or the Ray actor's client)."""

    async def acquire_batch(self, request: BatchRequest) -> list[Token]: ...

    async def release_batch(self, tokens: list[Token]) -> None: ...

    async def release_tokens(self, tokens: list[Token]) -> None:
        """Give back some tokens of one admitted batch early (early release); the batch still closes
        whole with ``release_batch``, which frees what it holds then. A pool that cannot free a
        token before its batch closes makes this a no-op."""
        ...

    async def max_tokens_for(self, per_sample: Resource) -> int: ...


class DataSource(Protocol):
    async def get_tasks(self, n: int) -> list[Task]: ...


@runtime_checkable
class ResumableSource(DataSource, Protocol):
    """A data source whose stream can be saved and set back (what a rollout checkpoint needs):
    ``load_state_dict(state_dict())`` later makes ``get_tasks`` hand out the same tasks again."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StepLog(Protocol):
    """Groups of a rollout step finished in an earlier attempt, and the record of each one finished
    now (``steps.checkpoint`` keeps them on disk so that a step cut short resumes)."""

    async def finished(self, tasks: list[Task]) -> Mapping[int, list[Sample]]:
        """Given the step's fetch, the groups already finished, by fetch index: not run again, and
        returned in place. Raising here fails the step before anything runs."""
        ...

    async def group_done(self, index: int, samples: list[Sample]) -> None:
        """Group ``index`` finished (called before ``on_task_done`` fires for it)."""
        ...


class IterationSource(Protocol):
    """Per-iteration state the scheduler publishes (docs/scheduler.md §5), e.g. a DAgger schedule: the Iteration it
    returns goes to every agent (``EpisodeContext.iteration``) and back with the step's results."""

    def rollout_state(self, rollout_id: int) -> Iteration: ...

    def eval_state(self, rollout_id: int) -> Iteration: ...


_Count = Annotated[int, Meta(ge=1, le=MAX_STEP_SAMPLES)]


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The scheduler's settings, defined once: the recipe's ``scheduler`` section is this Struct
    with the recipe's own keys added (``recipe.config.SchedulerSection``), so both read the same
    bounds, defaults and descriptions."""

    rollout_batch_size: Annotated[_Count, Meta(description="tasks (prompts) fetched per rollout step")] = 8
    n_samples_per_eval_prompt: Annotated[_Count, Meta(description="samples per eval prompt (pass@k for k up "
                                                                  "to it)")] = 1
    global_stopping: Annotated[StoppingCriteria, Meta(
        description="stopping criteria of every evaluator, the cascade's lowest level")] = StoppingCriteria()
    global_sampling: Annotated[SamplingParams, Meta(
        description="sampling params of every evaluator, the cascade's lowest level")] = SamplingParams()
    # No limit by default: a batch waits for the batches ahead of it, and agentic episodes run for
    # hours; it is never waiting for a grant that cannot come (``run_all`` refuses a batch larger
    # than the pool can ever admit), and each call to a remote pool is bounded by its client.
    acquire_timeout_s: Annotated[Annotated[float, Meta(gt=0, le=MAX_SECONDS)] | None, Meta(description=(
        "seconds a batch may wait for the pool to admit it, then the step fails; unset: as long as the "
        "batches ahead of it run (a batch the pool can never admit fails at once)"))] = None
    progress: Annotated[bool, Meta(description="show a progress bar per step")] = True


class StepContext(msgspec.Struct, frozen=True):
    """One step's own values, built once when the step starts and handed to every batch and
    Evaluator of it (rather than threaded through as loose arguments)."""

    rollout_id: int
    kind: StepKind = StepKind.ROLLOUT
    iteration: Iteration = Iteration()  # what the IterationSource published for the step
    complete_after: int | None = None  # the step completes once this many groups are handed on


@runtime_checkable
class Rollouts(Protocol):
    """Something that runs a rollout step: the TaskScheduler, and the wrappers that compose over
    one (``steps.checkpoint.ResumableRollouts``, ``steps.partial.PartialRollouts``); each also
    takes, as keyword arguments, what the wrapper above it passes down. ``on_task_done`` fires once
    per group finished now, with the group as the caller should see it."""

    async def execute_rollout(self, rollout_id: int, on_task_done: OnTaskDone | None = None) -> RolloutResult: ...


class StepState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StepStatus(msgspec.Struct):
    """The step in flight, or the last one. ``state`` says how it ended; the counters are progress."""

    kind: StepKind | None = None
    state: StepState = StepState.IDLE
    rollout_id: int | None = None
    batches: int = 0
    batches_waiting: int = 0
    batches_running: int = 0
    batches_done: int = 0
    tasks: int = 0  # tasks this step runs (a resumed step's finished groups not counted)
    tasks_done: int = 0  # of those, finished and passed to the step log and the callback
    samples_done: int = 0
    started_at: float | None = None  # the loop's clock (core.clock), seconds

    @property
    def phase(self) -> str:
        """One word for displays: ``idle``, ``rollout`` (running), ``rollout done``, ``eval failed``, ..."""
        if self.kind is None:
            return StepState.IDLE.value
        return self.kind.value if self.state is StepState.RUNNING else f"{self.kind.value} {self.state.value}"

    def as_dict(self) -> dict[str, Any]:
        """Plain data for JSON (the manager's GET /status): ``phase`` and every field."""
        return {"phase": self.phase, **msgspec.to_builtins(self)}


class UnfinishedGroup(msgspec.Struct):
    """A group a step cut short (``complete_after``): its task, its fetch index, and its samples as
    they were left. A sample that ended keeps its result; one that was cancelled is PENDING with
    its episode record so far (``Sample.episode``: the turns it did)."""

    index: int
    task: Task
    samples: list[Sample]


class RolloutResult(msgspec.Struct):
    rollout_id: int
    groups: list[list[Sample]]  # one group per task, in fetch order (with complete_after: the complete ones)
    metrics: dict[str, float] = {}
    iteration: Iteration = Iteration()  # what the IterationSource published for this step
    artifacts: dict[str, str] = {}  # files the step wrote or read, by kind (set by the host, e.g. the manager)
    unfinished: list[UnfinishedGroup] = []  # with complete_after: the groups cut short, in fetch order


class EvalResult(msgspec.Struct):
    rollout_id: int
    metrics: dict[str, float]
    samples: dict[str, list[Sample]]  # by dataset name
    iteration: Iteration = Iteration()
    artifacts: dict[str, str] = {}


def identified(rollout_id: int, tasks: list[Task]) -> list[Task]:
    """Each fetched task as the group it starts: one that carries a ``TaskKey.GROUP_ID`` (a group
    carried on from an earlier step) keeps it; any other gets ``"<rollout_id>/<fetch index>"``, on
    a copy, so that the same task fetched twice makes two groups, each known by its own id. The
    ids are a function of the fetch, so a resumed step gives its groups the same ones again."""
    key, out, ids = TaskKey.GROUP_ID.value, [], set()
    for i, t in enumerate(tasks):
        if key not in t.metadata:
            meta = t.metadata.copy()
            meta[key] = f"{rollout_id}/{i}"
            t = msgspec.structs.replace(t, metadata=meta)
        out.append(t)
        ids.add(t.metadata[key])
    if len(ids) < len(out):
        ids = [t.metadata[key] for t in out]
        raise ValueError(f"rollout {rollout_id}: two fetched tasks carry the same {key} "
                         f"{sorted({g for g in ids if ids.count(g) > 1})}: a group handed in twice")
    return out


def check_protocols(data_source: Any, pool: Any, on_task_done: Any, iteration: Any) -> None:
    """What the scheduler is handed fits its protocols (``core.contracts``), checked here rather than
    failing mid-step: which object, which method, and what it must be."""
    if data_source is not None:
        require_async(data_source, "get_tasks", "data_source", "async def get_tasks(self, n: int) -> list[Task]")
    if pool is not None:
        for method in ("acquire_batch", "release_batch", "release_tokens", "max_tokens_for"):
            hint = "; a pool that frees nothing early makes it a no-op" if method == "release_tokens" else ""
            require_async(pool, method, "pool", f"async def {method}(...) (core.contracts.Pool){hint}")
    if on_task_done is not None:
        require_async(on_task_done, None, "on_task_done", "async (task, samples) -> None")
    if iteration is not None:
        for method in ("rollout_state", "eval_state"):
            fn = getattr(iteration, method, None)
            if not callable(fn) or inspect.iscoroutinefunction(fn):
                raise TypeError(f"iteration {type(iteration).__name__}.{method}: "
                                f"{'missing' if fn is None else 'not a plain function'}; it must be "
                                f"def {method}(self, rollout_id: int) -> Iteration (it is called, not awaited)")
