"""The episode's typed record (docs/architecture.md "The episode record"): what one episode did, kept as
Structs on the sample (``Sample.episode``) from the agent to the trainer's door, where
``rayapp.trainers.converters`` writes it as the spec's metadata keys; the enums it is made of; what a
partial rollout hands a carried group's task (``CarriedRun``); and the iteration's state every agent
gets (``Iteration``). Nothing here imports another module of the project: ``rayapp.types`` builds on it.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

# The name of the weights an engine serves, one type from the engine's report through the turn record,
# staleness, weight sync and the trainer's metadata. An int, because every use is arithmetic or order
# (the manager names each update the last applied + 1, and staleness is the current step minus the
# oldest version a sample used); the one backend that reports text (SGLang's meta_info) goes through
# ``weight_version_of`` once, where its answer is read. None where an engine names no version.
WeightVersion = Annotated[int, msgspec.Meta(ge=0)]


def weight_version_of(report: str | int | None, where: str) -> WeightVersion | None:
    """An engine's report of its weights as a ``WeightVersion``: None when it names none (None or "");
    text holding a non-negative integer as that int. Anything else is one ValueError naming ``where``."""
    if report is None or report == "":
        return None
    text = str(report)
    if not text.isdecimal():
        raise ValueError(f"{where}: weight_version {report!r} is not a non-negative integer")
    return int(text)


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


class EpisodePhase(enum.StrEnum):
    """The evaluator's two phases of one episode: the agent's run, then the verifier's. The trainer's
    ``_abort`` record names the verify phase "eval", as the spec does (``trainers.converters``)."""

    RUN = "run"
    VERIFY = "verify"


class Actor(enum.StrEnum):
    """Who acted at a model turn of a DAgger roll-in."""

    TEACHER = "teacher"
    STUDENT = "student"



class Placement(msgspec.Struct, gc=False):
    """The token an episode ran under: where, on which GPUs, what share of each. Made for every
    sample and kept to the trainer's door, so it stays out of the cyclic GC's walks (``gc=False``:
    a string, a tuple of ints and a float hold no cycle); ``gpu_ids`` is the token's own tuple."""

    node: str
    gpu_ids: tuple[int, ...]
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
    weight_version: WeightVersion | None = None


class ToolReplay(msgspec.Struct, forbid_unknown_fields=True):
    """A tool call an episode made, to replay in a fresh sandbox when the episode resumes."""

    name: str
    arguments: dict[str, Any] = {}


class DaggerLabel(msgspec.Struct):
    """The teacher's action in a state the student reached: its output for the same context."""

    turn: int
    state_len: int  # tokens of the state (the request's input ids)
    label_ids: list[int]
    text: str


class ResumePoint(msgspec.Struct, forbid_unknown_fields=True):
    """Where a cut-short episode can go on from (partial rollouts, ``policy: resume``): its token
    data after its last complete turn (the observation that followed included) and what rebuilds
    its environment, and, when the cut came mid-turn, the tokens that turn had generated
    (``partial``: the last ``partial`` of ``tokens``, with their log-probs and mask; the turn
    record of the weights that made them is the last of ``turn_records``). A resumed episode keeps
    all of these as they are and goes on with turn ``turns + 1`` from there; an agent that cannot
    rebuild its state ignores the point and starts afresh."""

    turns: int  # model turns done
    tokens: list[int]  # prompt + response so far
    prompt_len: int
    loss_mask: list[int]  # over the response so far
    rollout_log_probs: list[float]
    turn_records: list[TurnRecord] = []
    tool_calls: list[ToolReplay] = []  # the sandbox tool calls made, in order
    dagger_labels: list[DaggerLabel] = []  # a DAgger roll-in's teacher labels of the kept turns
    partial: Annotated[int, msgspec.Meta(ge=0)] = 0  # tokens of the cut turn at the end of ``tokens``

    def with_cut_turn(self, output_ids: list[int], logprobs: list[float], record: TurnRecord,
                      weight: int = 1) -> ResumePoint:
        """This point with the tokens a cut turn generated after it (loss weight ``weight``)."""
        return msgspec.structs.replace(
            self, tokens=[*self.tokens, *output_ids], loss_mask=[*self.loss_mask, *[weight] * len(output_ids)],
            rollout_log_probs=[*self.rollout_log_probs, *logprobs], turn_records=[*self.turn_records, record],
            partial=self.partial + len(output_ids))


class EpisodeTiming(msgspec.Struct, omit_defaults=True):
    """When one sample's episode waited and worked, on the evaluator's event-loop clock (seconds):
    its batch (``batch``, the scheduler's label) asked the pool (``queued``) and was granted
    (``admitted``; both unset when the batch ran ungated), the episode began on its token
    (``started``), how long its run and verify phases took (unset when it did not get through
    them) and when it ended, however it ended."""

    started: float
    batch: str | None = None
    queued: float | None = None
    admitted: float | None = None
    run_s: float | None = None
    verify_s: float | None = None
    ended: float | None = None


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


class EpisodeRecord(msgspec.Struct, omit_defaults=True, gc=False):
    """What one episode did, filled through its EpisodeContext: by the agent while it runs (turns,
    turn records, labels, the point it could resume from; kept current, so that an abort
    mid-episode still says how far it got) and by the evaluator (placement, the result's turns and
    reason, the abort, the timing). ``start`` is the point a partial rollout handed the episode to
    go on from (``CarriedRun``): an input, no part of the step's result. ``resume`` is kept only on
    a sample the step cut short (it stays PENDING)."""

    turns: int | None = None
    termination_reason: TerminationReason | None = None  # the agent's own
    placement: Placement | None = None
    # None yet: the one shared empty tuple, so that an episode with none (most short ones) allocates no
    # list that the cyclic GC would walk for the rest of the step; ``add_turn``/``add_label`` make it.
    turn_records: list[TurnRecord] = ()
    dagger_labels: list[DaggerLabel] = ()
    abort: AbortRecord | None = None
    resume: ResumePoint | None = None  # a resumable agent's state after its last complete turn
    timing: EpisodeTiming | None = None
    start: ResumePoint | None = None  # where this episode went on from (partial rollouts, ``policy: resume``)

    @property
    def reason(self) -> AbortReason | TerminationReason | None:
        """Why the episode ended as the trainer reads it (``_termination_reason``): the abort's reason
        when it was aborted, else the agent's own."""
        return self.abort.reason if self.abort is not None else self.termination_reason

    def add_turn(self, record: TurnRecord) -> None:
        if isinstance(self.turn_records, list):
            self.turn_records.append(record)
        else:
            self.turn_records = [*self.turn_records, record]

    def add_label(self, label: DaggerLabel) -> None:
        if isinstance(self.dagger_labels, list):
            self.dagger_labels.append(label)
        else:
            self.dagger_labels = [*self.dagger_labels, label]


class CarriedRun(msgspec.Struct, forbid_unknown_fields=True):
    """How a task runs what is left of a carried group (partial rollouts): the group's samples that
    have not ended, by their index in the group (``indices``, one sample each, in order), and for
    each the point it goes on from (``points``, None: afresh; empty: all afresh)."""

    indices: list[int]
    points: list[ResumePoint | None] = []


class Iteration(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the step's IterationSource published (a DAgger schedule's β and roll-in tail), the same
    value for every agent of the step and returned with its result. ``t_max`` 0: no tail, every turn
    may be the teacher's; ``rollout_id`` None: no source published anything."""

    rollout_id: int | None = None
    beta: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # probability that the teacher acts at a turn
    t_max: Annotated[int, msgspec.Meta(ge=0)] = 0
    t_max_step: int = 0
