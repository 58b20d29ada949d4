"""The data model shared by every layer (spec §2-§4), as msgspec Structs.

The field annotations carry the bounds (``Meta(ge=...)``). Struct constructors do not check them:
whatever comes from outside (layouts, recipes, dataset rows, saved state) goes through the one door,
``rayapp.core.convert``, first, and code behind it trusts its types.
Structs pickle, so they cross Ray calls as they are.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

# Bounds the types carry, checked wherever outside input is converted (rayapp.core.convert). The upper
# bound of a float only rejects inf: msgspec lets inf through ``ge``, NaN fails any bound.
FINITE = sys.float_info.max


class Status(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


class TerminationReason(enum.StrEnum):
    """Why an agent ended its own episode (``AgentResult.termination_reason``)."""

    STOP = "stop"  # the model finished on its own
    MAX_TURNS = "max_turns"  # StoppingCriteria.max_turns model turns were used
    MAX_CONTEXT_LEN = "max_context_len"  # the episode filled StoppingCriteria.max_context_len tokens
    LENGTH = "length"  # a generation hit max_new_tokens (or the engine's context) with room left


class AbortReason(enum.StrEnum):
    """Why the evaluator aborted an episode: the transport class of the error (``classify_abort``)."""

    AGENT_TIMEOUT = "agent_timeout"  # the episode or a step of it ran out of time
    INFRA_CONN = "infra_conn"  # the inference engine (or another service) could not be reached
    INFRA_SANDBOX = "infra_sandbox"  # the sandbox crashed, was killed or ran out of memory
    INFRA_OTHER = "infra_other"  # anything else: a bug, a bad result shape, ...


class StepKind(enum.StrEnum):
    """The scheduler step an episode belongs to."""

    ROLLOUT = "rollout"
    EVAL = "eval"


class EpisodePhase(enum.StrEnum):
    """The evaluator's two phases of one episode. The verifier's value stays "eval", the word
    abort records have always carried."""

    RUN = "run"
    VERIFY = "eval"


class Actor(enum.StrEnum):
    """Who acted at a model turn of a DAgger roll-in."""

    TEACHER = "teacher"
    STUDENT = "student"


class Resource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Supply or demand of one thing that the pool gates: a GPU fraction (or whole GPUs), an
    asyncio concurrency ceiling, CPU cores and memory. ``gpu`` in (0, 1] shares one GPU; above 1 it
    must be a whole number of GPUs on one node."""

    gpu: Annotated[float, Meta(ge=0, le=FINITE, description="GPUs: 0 none, a share of one GPU in (0, 1], or a "
                                                            "whole number above 1 (all on one node)")] = 0.0
    concurrency: Annotated[int, Meta(ge=0, description="samples at once: a budget's cap, and what one sample "
                                                       "counts against it")] = 1  # 0: not counted
    cpu: Annotated[float, Meta(ge=0, le=FINITE, description="CPU cores")] = 0.0
    memory_gb: Annotated[float, Meta(ge=0, le=FINITE, description="memory, GB")] = 0.0

    def peak(self, other: Resource) -> Resource:
        """Per-field max: the most one sample holds when it runs ``self`` then ``other``."""
        return Resource(
            gpu=max(self.gpu, other.gpu),
            concurrency=max(self.concurrency, other.concurrency),
            cpu=max(self.cpu, other.cpu),
            memory_gb=max(self.memory_gb, other.memory_gb),
        )


class StoppingCriteria(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """When an episode stops. ``None`` means "not set at this level" in the cascade (spec §2);
    after resolution a ``None`` left over means "no limit"."""

    max_turns: Annotated[int, Meta(ge=1, description="most model turns in one episode of a multi-turn agent "
                                                     "(unset: 1)")] | None = None
    max_context_len: Annotated[int, Meta(ge=1, description="most tokens in an episode, prompt + response; the "
                                                           "agent stops there (truncated)")] | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=FINITE, description="wall-clock limit of a sample's run phase, "
                                                                  "seconds; past it the sample aborts")] | None = None


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Generation settings handed to the inference engine; ``None`` as in StoppingCriteria."""

    temperature: Annotated[float, Meta(ge=0, le=FINITE, description="sampling temperature, >= 0; 0 = greedy "
                                                                    "(unset: 1.0)")] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, description="nucleus sampling: the probability mass kept, "
                                                         "in (0, 1]")] | None = None
    top_k: Annotated[int, Meta(ge=-1, description="sample among the k likeliest tokens; -1 = off")] | None = None
    max_new_tokens: Annotated[int, Meta(ge=1, description="most tokens generated per model turn (unset: 128, or "
                                                          "what max_context_len leaves)")] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(description="strings that end a "
                                                                               "generation")] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1, description="the request's sampling seed (unset: the engine picks "
                                                          "one)")] | None = None

    def __post_init__(self) -> None:
        # The one rule a bound cannot say (top_k is -1 or >= 1); a ValueError here is an InputError at
        # the door, and a constructor in code fails at once.
        if self.top_k == 0:
            raise ValueError("$.top_k: expected -1 (off) or int >= 1, got 0")


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True):
    task_type: str
    evaluator_id: str | None = None  # defaults to task_type
    n_samples: Annotated[int, Meta(ge=1)] = 1  # samples in this task's group (GRPO-style)
    # expected episode length, read by longest_first_batching
    expected_len: Annotated[float, Meta(ge=0, le=FINITE)] | None = None


class Task(msgspec.Struct, forbid_unknown_fields=True):
    task_id: str
    prompt: str | list[dict[str, Any]]
    config: TaskConfig
    label: Any = None
    metadata: dict[str, Any] = {}

    @property
    def evaluator_id(self) -> str:
        return self.config.evaluator_id or self.config.task_type


class Batch(msgspec.Struct):
    task_type: str
    tasks: list[Task] = []

    @property
    def evaluator_id(self) -> str:
        return self.tasks[0].evaluator_id if self.tasks else self.task_type

    @property
    def n_samples(self) -> int:
        return sum(t.config.n_samples for t in self.tasks)


class Sample(msgspec.Struct):
    """One episode's outcome, shaped for the trainer. ``tokens`` is prompt + response;
    ``loss_mask`` and ``rollout_log_probs`` cover the last ``response_length`` tokens."""

    task_id: str
    index: int  # position in the task's group
    prompt: str | list[dict[str, Any]]
    label: Any = None
    status: Status = Status.PENDING
    tokens: list[int] = []
    response: str = ""
    response_length: int = 0
    rollout_log_probs: list[float] = []
    loss_mask: list[int] = []
    reward: dict[str, float] = {}
    metadata: dict[str, Any] = {}
    remove_sample: bool = False


class Token(msgspec.Struct, frozen=True, gc=False):
    """One placement token: what one running sample holds, and where. ``gpu`` is the fraction
    held on each of ``gpu_ids`` (1.0 for whole GPUs)."""

    token_id: int
    node: str
    gpu_ids: tuple[int, ...]
    gpu: float
    cpu: float
    memory_gb: float
    placement_group: str = ""  # the Ray placement group reserving it (set by the Ray shell)
    bundle_index: int = -1  # its bundle in that group


class AgentResult(msgspec.Struct):
    """What an agent's run phase returns (spec §4); the evaluator copies the token data onto the
    sample. ``tokens`` is prompt + response as in Sample."""

    tokens: list[int]
    response_length: int
    response: str = ""
    rollout_log_probs: list[float] = []
    loss_mask: list[int] = []
    turns: int = 1
    termination_reason: TerminationReason | None = None  # the agent's own
    truncated: bool = False
    metadata: dict[str, Any] = {}


class Placement(msgspec.Struct):
    """The token an episode ran under: where, on which GPUs, what share of each."""

    node: str
    gpu_ids: list[int]
    gpu: float


class TurnRecord(msgspec.Struct, omit_defaults=True):
    """One model turn: which engine answered, how long the call took (``engine_s``, seconds on the
    episode's event-loop clock) and where the episode's token sat (``node`` and ``gpu_ids`` are unset
    without a token); ``actor`` only in a DAgger roll-in. ``weight_version`` names the weights that
    produced the turn (the engine's report; a partial rollout stamps the step's index where it gave
    none), so a trainer sees how stale a turn carried across steps is."""

    turn: int
    engine: str
    node: str | None = None
    gpu_ids: list[int] | None = None
    actor: Actor | None = None
    engine_s: float | None = None
    weight_version: str | None = None


class ToolReplay(msgspec.Struct, forbid_unknown_fields=True):
    """A tool call an episode made, to replay in a fresh sandbox when the episode resumes."""

    name: str
    arguments: dict[str, Any] = {}


RESUME_POINTS = "_resume_points"  # task metadata: each sample's ResumePoint (plain data) or None, by index


class ResumePoint(msgspec.Struct, forbid_unknown_fields=True):
    """Where a cut-short episode can go on from (partial rollouts, ``policy: resume``): its token
    data after its last complete turn (the observation that followed included) and what rebuilds
    its environment. A resumed episode keeps these tokens, log-probs, mask and turn records as they
    are and generates its next turn again; an agent that cannot rebuild its state ignores it and
    starts afresh."""

    turns: int  # model turns done
    tokens: list[int]  # prompt + response so far
    prompt_len: int
    loss_mask: list[int]  # over the response so far
    rollout_log_probs: list[float]
    turn_records: list[TurnRecord] = []
    tool_calls: list[ToolReplay] = []  # the sandbox tool calls made, in order


class DaggerLabel(msgspec.Struct):
    """The teacher's action in a state the student reached: its output for the same context."""

    turn: int
    state_len: int  # tokens of the state (the request's input ids)
    label_ids: list[int]
    text: str


class AbortRecord(msgspec.Struct):
    """What a failure summary needs of an aborted episode."""

    reason: AbortReason
    phase: EpisodePhase
    window: list[float]  # [started, ended]: the evaluator's clock at the episode's start and at its abort
    elapsed_s: float
    node: str | None
    gpu_ids: list[int]
    turns: int
    error: str


class TaskKey(enum.StrEnum):
    """The ``metadata`` keys a task and its samples carry from the data source and the scheduler
    (spec §2, §5): where the task came from and how the cascade's third level reads it."""

    DATASET_NAME = "_dataset_name"  # the rollout dataset (MultiDataSource)
    DATASET_CFG = "_dataset_cfg"  # that dataset's flat overrides: the cascade's third level
    DATASET_EPOCH = "_dataset_epoch"  # how many times the dataset was read through before this task
    EVAL_DATASET_NAME = "_eval_dataset_name"  # the eval dataset (execute_eval)
    EVAL_COPY = "_eval_copy"  # which of the prompt's n_samples_per_eval_prompt copies
    ROLLOUT_ID = "_rollout_id"  # the step the sample belongs to


class EpisodeKey(enum.StrEnum):
    """The ``Sample.metadata`` keys the trainer reads of an episode (spec §4), written only by
    ``EpisodeRecord.to_metadata``."""

    TURNS = "_turns"
    TERMINATION_REASON = "_termination_reason"  # the abort reason when aborted, else the agent's
    TERMINATION_REASON_AGENT = "_termination_reason_agent"  # the agent's, when an abort overrode it
    PLACEMENT = "_placement"
    TURN_PLACEMENT = "_turn_placement"
    TURN_ACTOR = "_turn_actor"
    DAGGER_LABELS = "_dagger_labels"
    ABORT = "_abort"
    RESUME = "_resume"  # a cut-short sample's ResumePoint (partial rollouts), and a resumed one's start


class EpisodeRecord(msgspec.Struct):
    """What one episode did, filled through its EpisodeContext: by the agent while it runs (turns,
    turn records, labels; kept current, so that an abort mid-episode still says how far it got)
    and by the evaluator (placement, the result's turns and reason, the abort)."""

    turns: int | None = None
    termination_reason: TerminationReason | None = None  # the agent's own
    placement: Placement | None = None
    turn_records: list[TurnRecord] = []
    dagger_labels: list[DaggerLabel] = []
    abort: AbortRecord | None = None
    resume: ResumePoint | None = None  # a resumable agent's state after its last complete turn

    def to_metadata(self) -> dict[str, Any]:
        """The spec's metadata keys of this record (``EpisodeKey``), plain data, set ones only."""
        out: dict[str, Any] = {}
        if self.placement is not None:
            out[EpisodeKey.PLACEMENT.value] = msgspec.to_builtins(self.placement)
        if self.turns is not None:
            out[EpisodeKey.TURNS.value] = self.turns
        if self.abort is not None:
            out[EpisodeKey.TERMINATION_REASON.value] = str(self.abort.reason)
            if self.termination_reason is not None:
                out[EpisodeKey.TERMINATION_REASON_AGENT.value] = str(self.termination_reason)
            abort = msgspec.to_builtins(self.abort)
            del abort["reason"]  # carried by _termination_reason
            out[EpisodeKey.ABORT.value] = abort
        elif self.turns is not None or self.termination_reason is not None:  # the run phase is over
            reason = self.termination_reason
            out[EpisodeKey.TERMINATION_REASON.value] = None if reason is None else str(reason)
        if self.turn_records:
            out[EpisodeKey.TURN_PLACEMENT.value] = msgspec.to_builtins(self.turn_records)
            actors = [str(t.actor) for t in self.turn_records if t.actor is not None]
            if actors:
                out[EpisodeKey.TURN_ACTOR.value] = actors
        if self.dagger_labels:
            out[EpisodeKey.DAGGER_LABELS.value] = msgspec.to_builtins(self.dagger_labels)
        return out


R = TypeVar("R")


class EpisodeContext(msgspec.Struct):
    """What the evaluator hands an agent for one sample: its token, its resolved settings, the
    episode's record, and the resources the agent keeps between the run and verify phases.

    The evaluator enters the context (``async with ctx``) around both phases and so closes what
    was kept whatever happens, cancellation included; an agent run outside an evaluator should be
    entered the same way."""

    rollout_id: int
    token: Token | None
    stopping: StoppingCriteria
    sampling: SamplingParams
    iteration: dict[str, Any] = {}  # the iteration's published state (e.g. DAgger beta, t_max)
    step: StepKind = StepKind.ROLLOUT
    record: EpisodeRecord = msgspec.field(default_factory=EpisodeRecord)
    _kept: dict[str, Any] = {}
    _exits: AsyncExitStack | None = None  # made by the first keep: most episodes keep nothing

    def record_turn(self, turn: int, engine: str, actor: Actor | None = None, *,
                    engine_s: float | None = None, weight_version: str | None = None) -> None:
        """Count model turn ``turn`` as done and record who answered it, where, how long the engine
        took (``engine_s``) and with which weights (``weight_version``, as the engine names them)."""
        self.record.turns = turn
        where = (self.token.node, list(self.token.gpu_ids)) if self.token is not None else (None, None)
        self.record.turn_records.append(TurnRecord(turn, engine, *where, actor=actor, engine_s=engine_s,
                                                   weight_version=weight_version or None))

    def keep(self, name: str, resource: R, close: Callable[[], Awaitable[Any]]) -> R:
        """Hold ``resource`` under ``name`` until the episode ends; ``close()`` is awaited then."""
        if name in self._kept:
            raise ValueError(f"episode {self.rollout_id}: a resource named {name!r} is already kept")
        self._kept[name] = resource
        if self._exits is None:
            self._exits = AsyncExitStack()
        self._exits.push_async_callback(close)
        return resource

    def kept(self, name: str) -> Any:
        """The resource kept under ``name``; KeyError when none is."""
        return self._kept[name]

    async def __aenter__(self) -> EpisodeContext:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._exits is None:
            return
        self._kept.clear()
        await self._exits.aclose()


class EvaluatorSpec(msgspec.Struct):
    """Binds a handler (the agent that owns the episode) to a resource model (spec §4).
    ``resource`` is the per-evaluator budget; ``run_resource``/``eval_resource`` what one sample
    needs in each phase."""

    evaluator_id: str
    handler: Any
    resource: Resource = Resource()
    run_resource: Resource = Resource()
    eval_resource: Resource = Resource()
    batch_size: int | None = None
    default_stopping: StoppingCriteria = StoppingCriteria()
    default_sampling: SamplingParams = SamplingParams()
    eval_timeout_s: float = 300.0

    @property
    def sample_resource(self) -> Resource:
        """The peak one sample holds: run and eval never overlap, so the per-field max."""
        return self.run_resource.peak(self.eval_resource)


class NodeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node of a cluster layout (spec §3)."""

    gpus: tuple[Annotated[int, Meta(ge=0)], ...] = ()
    cpu: Annotated[float, Meta(ge=0, le=FINITE)] = 0.0
    memory_gb: Annotated[float, Meta(ge=0, le=FINITE)] = 0.0


class BatchRequest(msgspec.Struct, frozen=True):
    """One batch's admission request to the placement pool (spec §3): ``min(budget_tokens(budget,
    per_sample), max_tokens)`` tokens of ``per_sample``, all or none. ``label`` names the batch in
    errors and in what realises it (the Ray placement group); ``owner`` is the caller that holds it
    (a manager replica), so whatever it left behind can be freed at once; ``timeout_s`` bounds the
    wait (None: wait until admitted)."""

    budget: Resource
    per_sample: Resource
    max_tokens: int
    label: str = "batch"
    owner: str = ""
    timeout_s: float | None = None
