"""The DAgger schedule and the per-iteration state the scheduler publishes (docs/scheduler.md §5).

``DAggerSchedule`` maps a rollout index to the mixing weight β (the probability that the teacher,
not the student, acts at a turn) and to t_max (the roll-in tail length); the decays and the ramp
are in docs/scheduler.md, "DAgger". It exists because the scheduler alone knows the rollout index:
``DAggerIterations`` gives it each iteration's state as an ``Iteration`` (agents read
``EpisodeContext.iteration``) and tells its observers (``stacx_env.StacxEnv`` writes the spec's
``STACX_*`` variables); a recipe without DAgger has ``StepIterations``. Invariants: β is a pure
function of (schedule, t), never increasing, so a resumed or replayed rollout sees the same value;
a schedule that exists is valid (bad values are one ValueError naming the flag).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, get_args

import msgspec

from rayapp.record import Actor, Iteration
from rayapp.types import MAX_STEPS, MAX_TURNS, StepKind

BetaSchedule = Literal["linear", "cosine", "exponential", "step"]
BETA_SCHEDULES: tuple[str, ...] = get_args(BetaSchedule)

# Code-set per iteration by the scheduler: never set these by hand (docs/scheduler.md §6).
ENV_ROLLOUT_ID = "STACX_ROLLOUT_ID"
ENV_BETA = "STACX_DAGGER_BETA"
ENV_T_MAX = "STACX_DAGGER_T_MAX"
# Set by the user: the β eval should run at instead of the student-only default of 0.
ENV_EVAL_BETA = "STACX_DAGGER_EVAL_BETA"

# name -> meaning, for the knob reference; "code-set" marks the ones never to be set by hand.
ENV_VARS: dict[str, str] = {
    ENV_ROLLOUT_ID: "code-set by every rollout step, with or without DAgger: the rollout index in flight",
    ENV_BETA: "code-set: the iteration's DAgger β (probability the teacher acts); popped by eval",
    ENV_T_MAX: ("the iteration's roll-in tail length t_max: code-set when --dagger-t-max-step > 0; with the "
                "ramp off, a value set by hand is kept and is the t_max agents get"),
    ENV_EVAL_BETA: "user-set: re-injects this β for eval (default: eval runs student-only at β=0)",
}

# Struct field -> CLI flag: every error names the flag a user can actually change.
FLAGS: dict[str, str] = {
    "beta_schedule": "--dagger-beta-schedule",
    "beta_start": "--dagger-beta-start",
    "beta_end": "--dagger-beta-end",
    "decay_iters": "--dagger-decay-iters",
    "gamma": "--dagger-gamma",
    "step_size": "--dagger-step-size",
    "step_gamma": "--dagger-step-gamma",
    "t_max_start": "--dagger-t-max-start",
    "t_max_end": "--dagger-t-max-end",
    "t_max_step": "--dagger-t-max-step",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class DAggerSchedule(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """β decay plus a linear t_max ramp; see the module docstring for the formulas.

    ``step_gamma`` None means "use ``gamma``", so ``--dagger-gamma`` alone configures either
    multiplicative kind."""

    beta_schedule: BetaSchedule = "linear"
    beta_start: float = 1.0
    beta_end: float = 0.0
    decay_iters: int = 10
    gamma: float = 0.5
    step_size: int = 2
    step_gamma: float | None = None
    t_max_start: int = 0
    t_max_end: int = 0
    t_max_step: int = 0

    def __post_init__(self) -> None:
        # Struct constructors do not type-check, so this is the one gate every path goes through.
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"{FLAGS[field]}: {why}, got {getattr(self, field)!r}")

        if self.beta_schedule not in BETA_SCHEDULES:
            raise bad("beta_schedule", f"unknown schedule; choose one of {', '.join(BETA_SCHEDULES)}")
        for field in ("beta_start", "beta_end", "gamma", "step_gamma"):
            value = getattr(self, field)
            if field == "step_gamma" and value is None:
                continue
            # `not 0 <= v <= 1` also rejects NaN; a factor above 1 would make β grow.
            if not _is_real(value) or not 0.0 <= value <= 1.0:
                raise bad(field, "must be a number in [0, 1]")
        if self.beta_end > self.beta_start:
            raise bad("beta_end", f"must not exceed {FLAGS['beta_start']} ({self.beta_start!r}): β only decays")
        # iterations and turns past a real run's: a typo (10^9), not a plan
        for field, least, most in (("decay_iters", 0, MAX_STEPS), ("step_size", 1, MAX_STEPS),
                                   ("t_max_start", 0, MAX_TURNS), ("t_max_end", 0, MAX_TURNS),
                                   ("t_max_step", 0, MAX_TURNS)):
            value = getattr(self, field)
            if not _is_int(value) or value < least:
                raise bad(field, f"must be an integer >= {least}")
            if value > most:
                raise bad(field, f"must be an integer <= {most}")

    # -- the schedule ------------------------------------------------------------------------

    @property
    def effective_step_gamma(self) -> float:
        return self.gamma if self.step_gamma is None else self.step_gamma

    def beta(self, iteration: int) -> float:
        t = _check_iteration(iteration)
        start, end = float(self.beta_start), float(self.beta_end)
        kind, T = self.beta_schedule, self.decay_iters
        if kind in ("linear", "cosine") and t >= T:
            return end  # exact, not start - (start - end), which can miss end by an ulp
        if kind == "linear":
            # start - d*f rounds monotonically in f (unlike start*(1-f) + end*f), so β never
            # ticks upward by an ulp between iterations.
            value = start - (start - end) * (t / T)
        elif kind == "cosine":
            value = end + (start - end) * (1.0 + math.cos(math.pi * t / T)) / 2.0
        elif kind == "exponential":
            value = start * float(self.gamma) ** t
        else:  # step
            value = start * float(self.effective_step_gamma) ** (t // self.step_size)
        # The clamp keeps rounding (cos(0) + 1 over 2, say) inside [end, start].
        return min(start, max(end, value))

    def t_max(self, iteration: int) -> int:
        t = _check_iteration(iteration)
        if self.t_max_step == 0:
            return self.t_max_start
        span = self.t_max_end - self.t_max_start
        moved = min(self.t_max_step * t, abs(span))  # integers: the ramp reaches t_max_end exactly
        return self.t_max_start + (moved if span >= 0 else -moved)

    def state(self, iteration: int) -> Iteration:
        """The schedule's values at ``iteration`` (before the t_max guard ``DAggerIterations`` applies)."""
        return Iteration(rollout_id=_check_iteration(iteration), beta=self.beta(iteration),
                         t_max=self.t_max(iteration), t_max_step=self.t_max_step)

    # -- construction from flags -------------------------------------------------------------

    @classmethod
    def from_flags(cls, flags: Sequence[str] | Mapping[str, Any] | argparse.Namespace | None = None) -> DAggerSchedule:
        """Build from CLI-style flags: an argv list (flags of other components are left alone,
        but an unknown ``--dagger-*`` flag is an error, not a silent no-op), a mapping keyed by
        flag (``"--dagger-beta-start"``, ``"dagger_beta_start"`` or ``"beta_start"``), or the
        Namespace of a parser that ``add_dagger_args`` extended. Absent flags take defaults."""
        if isinstance(flags, argparse.Namespace):
            values = {f: getattr(flags, _dest(f)) for f in FLAGS if hasattr(flags, _dest(f))}
            return cls(**values)
        argv = _mapping_to_argv(flags) if isinstance(flags, Mapping) else list(flags or [])
        parser = _RaisingParser(prog="dagger", add_help=False, allow_abbrev=False)
        add_dagger_args(parser)
        ns, rest = parser.parse_known_args(argv)
        unknown = [a for a in rest if a.startswith("--dagger-")]
        if unknown:
            raise ValueError(f"{unknown[0].split('=')[0]}: unknown DAgger flag; known: {', '.join(FLAGS.values())}")
        return cls.from_flags(ns)


def _dest(field: str) -> str:
    return "dagger_" + field


def _check_iteration(iteration: int) -> int:
    if not _is_int(iteration) or iteration < 0:
        raise ValueError(f"iteration must be an integer >= 0, got {iteration!r}")
    return iteration


class _RaisingParser(argparse.ArgumentParser):
    """argparse exits the process on a bad value; a library raises instead."""

    def error(self, message: str) -> Any:  # argparse's messages already name the flag
        raise ValueError(message)


def _mapping_to_argv(flags: Mapping[str, Any]) -> list[str]:
    argv = []
    for key, value in flags.items():
        name = key.lstrip("-").replace("_", "-")
        flag = "--" + (name if name.startswith("dagger-") else "dagger-" + name)
        if flag not in FLAGS.values():
            raise ValueError(f"{key}: unknown DAgger flag; known: {', '.join(FLAGS.values())}")
        if value is not None:  # None: "not given", take the default
            argv.append(f"{flag}={value}")  # the = form keeps a negative number from reading as a flag
    return argv


# Struct field -> (type, help) of its --dagger-* flag; "%(default)s" is argparse's default.
_FLAG_HELP: dict[str, tuple[Any, str]] = {
    "beta_schedule": (str, "how β decays from --dagger-beta-start to --dagger-beta-end (default: %(default)s)"),
    "beta_start": (float, "β at iteration 0: probability that the teacher acts at a turn, in [0, 1] "
                          "(default: %(default)s)"),
    "beta_end": (float, "floor β decays to, in [0, --dagger-beta-start] (default: %(default)s)"),
    "decay_iters": (int, "iterations over which linear and cosine decay reach the floor (default: %(default)s)"),
    "gamma": (float, "per-iteration factor of the exponential decay, in [0, 1] (default: %(default)s)"),
    "step_size": (int, "the step decay multiplies β by --dagger-step-gamma every this many iterations "
                       "(default: %(default)s)"),
    "step_gamma": (float, "factor of the step decay, in [0, 1] (default: the value of --dagger-gamma)"),
    "t_max_start": (int, "roll-in tail length t_max at iteration 0 (default: %(default)s)"),
    "t_max_end": (int, "t_max the ramp stops at (default: %(default)s)"),
    "t_max_step": (int, "t_max change per iteration; 0 turns the ramp off and leaves STACX_DAGGER_T_MAX "
                        "unset (default: %(default)s)"),
}


def add_dagger_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the DAgger flags to ``parser`` (as one argument group, returned). Defaults come from
    ``DAggerSchedule``'s own, so the parser, the Struct and a generated knob reference agree."""
    d = DAggerSchedule()
    g = parser.add_argument_group("DAgger schedule", "β decay and t_max ramp, evaluated per rollout index")
    for field, flag in FLAGS.items():
        kind, help_text = _FLAG_HELP[field]
        choices = BETA_SCHEDULES if field == "beta_schedule" else None
        g.add_argument(flag, dest=_dest(field), type=kind, choices=choices, default=getattr(d, field),
                       help=help_text)
    return g


# -- the iteration ---------------------------------------------------------------------------

class IterationObserver(Protocol):
    """What is told each step's Iteration once it is known, before the step fetches anything."""

    def published(self, kind: StepKind, iteration: Iteration) -> None: ...


class DAggerIterations:
    """The TaskScheduler's IterationSource for a DAgger schedule: each step's Iteration, the value
    every agent of the step gets, told to ``observers`` (the environment's writer, ``StacxEnv``).
    ``execute_eval`` runs student-only unless ``eval_beta`` (STACX_DAGGER_EVAL_BETA) names a β.
    ``static_t_max``: a STACX_DAGGER_T_MAX set by hand (both read once, by ``rayapp.recipe.environment``).

    The t_max_step > 0 guard holds for agents too: ``t_max`` is 0 ("no tail, every turn may be the
    teacher's") unless it is a tail length. With the ramp on it is the ramp's value; with it off it
    is the statically set STACX_DAGGER_T_MAX when that is set, else ``t_max_start``. So the unused
    ramp's value never reaches an agent, as it never reaches the environment."""

    def __init__(self, schedule: DAggerSchedule, eval_beta: float = 0.0, static_t_max: int | None = None,
                 observers: Sequence[IterationObserver] = ()):
        self.schedule, self.eval_beta, self.static_t_max = schedule, eval_beta, static_t_max
        self.observers = list(observers)

    def rollout_state(self, rollout_id: int) -> Iteration:
        return self._published(StepKind.ROLLOUT, self._agents_view(self.schedule.state(rollout_id)))

    def eval_state(self, rollout_id: int) -> Iteration:
        view = self._agents_view(self.schedule.state(rollout_id))
        return self._published(StepKind.EVAL, msgspec.structs.replace(view, beta=self.eval_beta))

    def _published(self, kind: StepKind, iteration: Iteration) -> Iteration:
        for o in self.observers:
            o.published(kind, iteration)
        return iteration

    def _agents_view(self, state: Iteration) -> Iteration:
        t_max = state.t_max if state.t_max_step > 0 else self._static_t_max(state.t_max)
        return msgspec.structs.replace(state, t_max=max(t_max, 0))

    def _static_t_max(self, default: int) -> int:
        return default if self.static_t_max is None else self.static_t_max


class StepIterations:
    """The IterationSource of a recipe without DAgger: each step's Iteration names only its rollout id
    (β 0, no tail) and is told to ``observers`` all the same, so ``STACX_ROLLOUT_ID`` is published for
    every recipe, as docs/knobs.md says."""

    def __init__(self, observers: Sequence[IterationObserver] = ()):
        self.observers = list(observers)

    def rollout_state(self, rollout_id: int) -> Iteration:
        return self._published(StepKind.ROLLOUT, Iteration(rollout_id=rollout_id))

    def eval_state(self, rollout_id: int) -> Iteration:
        return self._published(StepKind.EVAL, Iteration(rollout_id=rollout_id))

    def _published(self, kind: StepKind, iteration: Iteration) -> Iteration:
        for o in self.observers:
            o.published(kind, iteration)
        return iteration


def roll_in_metrics(groups: Sequence[Sequence[Any]]) -> dict[str, float]:
    """Who acted in a step's DAgger roll-ins (the actors of the episodes' turn records), before any
    filter: ``dagger/turns/teacher``, ``dagger/turns/student``, ``dagger/labels`` (teacher labels
    kept for student turns) and ``dagger/teacher_turn_share``. Empty for a step with no roll-ins."""
    turns = {actor.value: 0 for actor in Actor}
    labels, seen = 0, False
    for group in groups:
        for s in group:
            actors = [t.actor for t in s.episode.turn_records if t.actor is not None]
            if not actors:
                continue
            seen = True
            for actor in actors:
                turns[actor] = turns.get(actor, 0) + 1
            labels += len(s.episode.dagger_labels)
    if not seen:
        return {}
    total = sum(turns.values())
    return {**{f"dagger/turns/{k}": float(v) for k, v in turns.items()}, "dagger/labels": float(labels),
            "dagger/teacher_turn_share": turns[Actor.TEACHER] / total if total else 0.0}
