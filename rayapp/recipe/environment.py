"""The user-set environment variables that configure a run, read once, when the recipe is built, into
one typed value (``RunEnvironment``; the variables: docs/knobs.md): nothing else in rayapp reads them.
The variables the scheduler sets per iteration (``STACX_ROLLOUT_ID``, ``STACX_DAGGER_BETA``, ...) are
written by ``steps/stacx_env.py`` alone. A bad value is one ``VariableError`` naming the variable."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from rayapp.core.convert import InputError
from rayapp.recipe.config import RecipeConfig, RecipeError
from rayapp.steps.dagger_schedule import ENV_EVAL_BETA, ENV_T_MAX
from rayapp.steps.reuse import ENV_KNOBS as REUSE_KNOBS
from rayapp.steps.reuse import ReusePolicy

# Launch-time environment variables the spec's recipes read (name -> (default, meaning)).
ENV_CONCURRENCY = "STACX_DAGGER_ENV_CONCURRENCY"
ENV_KNOBS: dict[str, tuple[str, str]] = {
    ENV_CONCURRENCY: ("(unset)", "user-set: when set, the per-evaluator concurrency (resource.concurrency, the "
                                 "ceiling of samples at once) of every SWE DAgger evaluator (env swe with a "
                                 "teacher); the spec's SWE recipe default is 4"),
}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class VariableError(RecipeError):
    """A user-set variable that does not fit: ``environment variable: NAME='value': reason``."""

    def __init__(self, name: str, raw: str, reason: str):
        self.name, self.raw, self.file = name, raw, name
        InputError.__init__(self, "environment variable", f"{name}={raw!r}", reason)

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.name, self.raw, self.reason)


@dataclass(frozen=True)
class RunEnvironment:
    """What the user-set variables say. ``env_concurrency``: STACX_DAGGER_ENV_CONCURRENCY (None: unset);
    ``eval_beta``: STACX_DAGGER_EVAL_BETA (eval's β; 0: student-only); ``static_t_max``: a
    STACX_DAGGER_T_MAX set by hand (kept while the recipe's t_max ramp is off); ``reuse``: the
    trajectory reuse policy (STACX_FORCE_FRESH_ROLLOUT, STACX_REUSE_ROLLOUT, STACX_REUSE_PER_ITER_DIR,
    STACX_SAVE_PER_ITER_PT)."""

    env_concurrency: int | None = None
    eval_beta: float = 0.0
    static_t_max: int | None = None
    reuse: ReusePolicy = field(default_factory=ReusePolicy)


def read_environment(environ: Mapping[str, str]) -> RunEnvironment:
    """Every user-set variable of ``environ``, checked; the first bad one is a VariableError. An empty
    value (``VAR=``) means unset."""
    def text(name: str) -> str:
        return environ.get(name, "").strip()

    concurrency = _number(environ, ENV_CONCURRENCY, int, lambda v: v >= 1, "expected an integer >= 1")
    beta = _number(environ, ENV_EVAL_BETA, float, lambda v: 0.0 <= v <= 1.0, "must be a number in [0, 1]")
    t_max = _number(environ, ENV_T_MAX, int, lambda v: v >= 0,
                    "a statically set tail length must be an integer >= 0")
    flags = {name: _flag(environ, name) for name in
             ("STACX_FORCE_FRESH_ROLLOUT", "STACX_REUSE_ROLLOUT", "STACX_SAVE_PER_ITER_PT")}
    folder = text("STACX_REUSE_PER_ITER_DIR")
    try:
        reuse = ReusePolicy(force_fresh=flags["STACX_FORCE_FRESH_ROLLOUT"], reuse_rollout=flags["STACX_REUSE_ROLLOUT"],
                            reuse_per_iter_dir=Path(folder).expanduser() if folder else None,
                            save_per_iter_pt=flags["STACX_SAVE_PER_ITER_PT"])
    except ValueError as e:  # two sources of reused trajectories
        raise VariableError("STACX_REUSE_PER_ITER_DIR", folder, str(e)) from None
    return RunEnvironment(concurrency, 0.0 if beta is None else beta, t_max, reuse)


def _number(environ: Mapping[str, str], name: str, kind: type, fits: object, reason: str) -> int | float | None:
    raw = environ.get(name, "")
    if not raw.strip():
        return None
    try:
        value = kind(raw.strip())
    except ValueError:
        value = math.nan  # reported below with the out-of-range reason
    if value != value or not fits(value):  # type: ignore[operator]
        raise VariableError(name, raw if len(raw) <= 40 else raw[:40] + "...", reason)
    return value


def _flag(environ: Mapping[str, str], name: str) -> bool:
    raw = environ.get(name, "").strip().lower() or REUSE_KNOBS[name][0]
    if raw in _TRUE | _FALSE:
        return raw in _TRUE
    raise VariableError(name, environ.get(name, ""), "expected 1 or 0 (or true/false, yes/no, on/off)")


def apply_env(recipe: RecipeConfig, environ: Mapping[str, str] | RunEnvironment) -> RecipeConfig:
    """The recipe with STACX_DAGGER_ENV_CONCURRENCY applied to its SWE DAgger evaluators (read in the
    manager's process: set it in the Serve config's ``runtime_env.env_vars`` or the shell of ``serve run``)."""
    env = environ if isinstance(environ, RunEnvironment) else read_environment(environ)
    if env.env_concurrency is None:
        return recipe
    evaluators = [msgspec.structs.replace(ev, resource=msgspec.structs.replace(ev.resource,
                                                                                concurrency=env.env_concurrency))
                  if ev.teacher is not None and ev.env == "swe" else ev for ev in recipe.evaluators]
    return msgspec.structs.replace(recipe, evaluators=evaluators)
