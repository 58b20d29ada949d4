"""The data model shared by every layer (docs/scheduler.md §2-§4), as msgspec Structs; the episode record they
carry is ``rayapp.record``.

The field annotations carry the bounds (``Meta(ge=...)``). Struct constructors do not check them:
whatever comes from outside (layouts, recipes, dataset rows, saved state) goes through the one door,
``rayapp.core.convert``, first, and code behind it trusts its types.
Structs pickle, so they cross Ray calls as they are.
"""

from __future__ import annotations

import enum
import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rayapp.record import CarriedRun, EpisodeRecord, TerminationReason

# Bounds the types carry, checked wherever outside input is converted (rayapp.core.convert). The upper
# bound of a float only rejects inf: msgspec lets inf through ``ge``, NaN fails any bound.
FINITE = sys.float_info.max
MAX_COUNT = 2**31 - 1  # the most of any count (turns, tokens, samples at once): more is a typo, not a plan
MAX_GPU_ID = 2**16  # a node's GPU ids are small integers; a huge one is a typo (or an attack on the pool)
# What a real run stays under, so that a recipe's 10^9 is refused rather than taken as "no limit" (unset is that):
MAX_TOKENS = 10_000_000  # tokens of an episode or a turn (the longest model contexts), and of a vocabulary
MAX_TURNS = 1_000_000  # model turns of one episode
MAX_SECONDS = 7 * 24 * 3600  # any timeout: a week
MAX_CONCURRENCY = 100_000  # samples or requests at once
MAX_STEP_SAMPLES = 1_000_000  # samples one step runs: more takes more memory than a manager has
MAX_STEPS = 1_000_000  # steps (iterations) of one training run


class Status(enum.StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


class StepKind(enum.StrEnum):
    """The scheduler step an episode belongs to."""

    ROLLOUT = "rollout"
    EVAL = "eval"


class Resource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Supply or demand of one thing that the pool gates: a GPU fraction (or whole GPUs), an
    asyncio concurrency ceiling, CPU cores and memory. ``gpu`` in (0, 1] shares one GPU; above 1 it
    must be a whole number of GPUs on one node."""

    gpu: Annotated[float, Meta(ge=0, le=FINITE, description="GPUs: 0 none, a share of one GPU in (0, 1], or a "
                                                            "whole number above 1 (all on one node)")] = 0.0
    concurrency: Annotated[int, Meta(ge=0, le=MAX_CONCURRENCY, description="samples at once: a budget's cap, and what "
                                                                     "one sample counts against it")] = 1  # 0: none
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
    """When an episode stops. ``None`` means "not set at this level" in the cascade (docs/scheduler.md §2);
    after resolution a ``None`` left over means "no limit"."""

    max_turns: Annotated[int, Meta(ge=1, le=MAX_TURNS, description="most model turns in one episode of a "
                                                                   "multi-turn agent (unset: 1)")] | None = None
    max_context_len: Annotated[int, Meta(ge=1, le=MAX_TOKENS, description="most tokens in an episode, prompt + "
                                                                          "response; the agent stops there "
                                                                          "(truncated)")] | None = None
    timeout_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS, description="wall-clock limit of a sample's run phase, "
                                                                  "seconds; past it the sample aborts")] | None = None


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Generation settings handed to the inference engine; ``None`` as in StoppingCriteria."""

    temperature: Annotated[float, Meta(ge=0, le=FINITE, description="sampling temperature, >= 0; 0 = greedy "
                                                                    "(unset: 1.0)")] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1, description="nucleus sampling: the probability mass kept, "
                                                         "in (0, 1]")] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOKENS, description="sample among the k likeliest tokens; "
                                                                "-1 = off")] | None = None
    max_new_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS, description="most tokens generated per model turn "
                                                                         "(unset: 128, or what max_context_len "
                                                                         "leaves)")] | None = None
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
    n_samples: Annotated[int, Meta(ge=1, le=MAX_STEP_SAMPLES)] = 1  # samples in this task's group (GRPO-style)
    # expected episode length, read by longest_first_batching
    expected_len: Annotated[float, Meta(ge=0, le=FINITE)] | None = None


class Task(msgspec.Struct, forbid_unknown_fields=True):
    task_id: str
    prompt: str | list[dict[str, Any]]
    config: TaskConfig
    label: Any = None
    metadata: dict[str, Any] = {}
    carried: CarriedRun | None = None  # set by partial rollouts on the task of a carried group's rest

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
    # what the episode did, typed; the trainer gets it as the spec's metadata keys (trainers.converters)
    episode: EpisodeRecord = msgspec.field(default_factory=EpisodeRecord)


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
    """What an agent's run phase returns (docs/scheduler.md §4); the evaluator copies the token data onto the
    sample. ``tokens`` is prompt + response as in Sample."""

    tokens: list[Annotated[int, Meta(ge=0, le=MAX_COUNT)]]  # token ids
    response_length: Annotated[int, Meta(ge=0, le=MAX_COUNT)]
    response: str = ""
    # a sampled token's log-probability: finite and <= 0 (NaN or a positive one is an engine or agent bug)
    rollout_log_probs: list[Annotated[float, Meta(ge=-FINITE, le=0)]] = []
    loss_mask: list[Literal[0, 1]] = []
    turns: int = 1
    termination_reason: TerminationReason | None = None  # the agent's own
    truncated: bool = False
    metadata: dict[str, Any] = {}


class TaskKey(enum.StrEnum):
    """The ``metadata`` keys a task and its samples carry from the data source and the scheduler
    (docs/scheduler.md §2, §5): where the task came from and how the cascade's third level reads it."""

    DATASET_NAME = "_dataset_name"  # the rollout dataset (MultiDataSource)
    DATASET_CFG = "_dataset_cfg"  # that dataset's flat overrides: the cascade's third level
    DATASET_EPOCH = "_dataset_epoch"  # how many times the dataset was read through before this task
    EVAL_DATASET_NAME = "_eval_dataset_name"  # the eval dataset (execute_eval)
    EVAL_COPY = "_eval_copy"  # which of the prompt's n_samples_per_eval_prompt copies
    ROLLOUT_ID = "_rollout_id"  # the step the sample belongs to
    # A rollout group's own identity, "<rollout id>/<fetch index>" of the step that first fetched its
    # task: kept while the group is carried (partial rollouts) and across checkpoints, unique among a
    # step's groups even when a small dataset hands out the same task twice (docs/training.md)
    GROUP_ID = "_group_id"


class EvaluatorSpec(msgspec.Struct):
    """Binds a handler (the agent that owns the episode) to a resource model (docs/scheduler.md §4).
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
    """One node of a cluster layout (docs/scheduler.md §3)."""

    gpus: tuple[Annotated[int, Meta(ge=0, le=MAX_GPU_ID)], ...] = ()
    cpu: Annotated[float, Meta(ge=0, le=FINITE)] = 0.0
    memory_gb: Annotated[float, Meta(ge=0, le=FINITE)] = 0.0


class BatchRequest(msgspec.Struct, frozen=True):
    """One batch's admission request to the placement pool (docs/scheduler.md §3): ``min(budget_tokens(budget,
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
