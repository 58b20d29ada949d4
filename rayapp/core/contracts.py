"""The scheduler's seams: what a step takes (the protocols of its data source, pool, step log and
iteration source; its settings) and what it gives (results, and the status of the step in flight).
They live apart from ``core.scheduler`` so that a host, a wrapper or a test can speak of them
without the scheduler itself.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal, Protocol

import msgspec
from msgspec import Meta

from rayapp.types import BatchRequest, Resource, Sample, SamplingParams, StepKind, StoppingCriteria, Task, Token

OnTaskDone = Callable[[Task, list[Sample]], Awaitable[None]]
Fetch = Callable[[], Awaitable[list[Task]]]  # a step's tasks in fetch order, in place of the data source's
Release = Literal["early", "batch_end"]


class Pool(Protocol):
    """What the scheduler needs of a placement pool (the core ledger, or the Ray actor's client)."""

    async def acquire_batch(self, request: BatchRequest) -> list[Token]: ...

    async def release_batch(self, tokens: list[Token]) -> None: ...

    async def release_tokens(self, tokens: list[Token]) -> None:
        """Give back some tokens of one admitted batch early (early release); the batch still closes
        whole with ``release_batch``, which frees what it holds then."""
        ...

    async def max_tokens_for(self, per_sample: Resource) -> int: ...


class DataSource(Protocol):
    async def get_tasks(self, n: int) -> list[Task]: ...


class StepLog(Protocol):
    """Groups of a rollout step finished in an earlier attempt, and the record of each one finished
    now (``training.checkpoint`` keeps them on disk so that a step cut short resumes)."""

    async def finished(self, tasks: list[Task]) -> Mapping[int, list[Sample]]:
        """Given the step's fetch, the groups already finished, by fetch index: not run again, and
        returned in place. Raising here fails the step before anything runs."""
        ...

    async def group_done(self, index: int, samples: list[Sample]) -> None:
        """Group ``index`` finished (called before ``on_task_done`` fires for it)."""
        ...


class IterationSource(Protocol):
    """Per-iteration state the scheduler publishes (spec §5), e.g. a DAgger schedule. Each call may
    publish environment variables too; the plain dict it returns goes to every agent and back with
    the step's results."""

    def rollout_state(self, rollout_id: int) -> dict[str, Any]: ...

    def eval_state(self, rollout_id: int) -> dict[str, Any]: ...


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The scheduler's settings (the recipe's ``scheduler`` section holds them and more)."""

    rollout_batch_size: Annotated[int, Meta(ge=1)] = 8  # tasks (groups) fetched per rollout step
    n_samples_per_eval_prompt: Annotated[int, Meta(ge=1)] = 1
    global_stopping: StoppingCriteria = StoppingCriteria()  # the cascade's lowest level
    global_sampling: SamplingParams = SamplingParams()
    acquire_timeout_s: float | None = None  # a batch not admitted within it fails the step
    progress: bool = True  # a tqdm bar per step
    # When a batch's capacity goes back to the pool: "early", each token as soon as no sample of
    # its batch waits for one (the sample that held it ended); "batch_end", all of it when the
    # batch's last sample ends (the spec's behaviour, kept to measure against).
    release: Release = "early"


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
    its episode record so far in its metadata (the turns it did, ``EpisodeKey.TURN_PLACEMENT``)."""

    index: int
    task: Task
    samples: list[Sample]


class RolloutResult(msgspec.Struct):
    rollout_id: int
    groups: list[list[Sample]]  # one group per task, in fetch order (with complete_after: the complete ones)
    metrics: dict[str, float] = {}
    iteration: dict[str, Any] = {}  # what the IterationSource published for this step
    artifacts: dict[str, str] = {}  # files the step wrote or read, by kind (set by the host, e.g. the manager)
    unfinished: list[UnfinishedGroup] = []  # with complete_after: the groups cut short, in fetch order


class EvalResult(msgspec.Struct):
    rollout_id: int
    metrics: dict[str, float]
    samples: dict[str, list[Sample]]  # by dataset name
    iteration: dict[str, Any] = {}
    artifacts: dict[str, str] = {}
