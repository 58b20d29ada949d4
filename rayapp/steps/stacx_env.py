"""The one writer of the process environment in ``rayapp.steps``: the spec's ``STACX_*`` variables
of the iteration in flight (docs/knobs.md), for code written against them (a trainer's hook, a
script an agent shells out to).

A process's environment is shared by everything in it: a Serve replica runs every step of its
manager, and a driver process may host more than one scheduler. So nothing in rayapp reads these
back; agents get the typed value (``EpisodeContext.iteration``), and this observer of the
``DAggerIterations`` (wired by ``rayapp.recipe``) is the only place they are written:

- every rollout step writes ``STACX_ROLLOUT_ID``, with or without DAgger;
- with DAgger (``dagger=True``), a rollout step also writes ``STACX_DAGGER_BETA`` (its ``repr``, which
  reads back as the same float), and ``STACX_DAGGER_T_MAX`` only when the ramp is on (``t_max_step > 0``):
  with it off a statically set tail length is left as it is;
- with DAgger, an eval step removes ``STACX_DAGGER_BETA`` (eval runs student-only at β=0), or, when
  ``STACX_DAGGER_EVAL_BETA`` is set, sets it to that β. Nothing is restored afterwards: the next
  rollout step writes its own.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from rayapp.record import Iteration
from rayapp.steps.dagger_schedule import ENV_BETA, ENV_EVAL_BETA, ENV_ROLLOUT_ID, ENV_T_MAX
from rayapp.types import StepKind


def env_values(iteration: Iteration, dagger: bool = True) -> dict[str, str]:
    """The variables a rollout step with ``iteration`` writes (module docstring)."""
    env = {ENV_ROLLOUT_ID: str(iteration.rollout_id)}
    if dagger:
        env[ENV_BETA] = repr(float(iteration.beta))
        if iteration.t_max_step > 0:
            env[ENV_T_MAX] = str(iteration.t_max)
    return env


class StacxEnv:
    """Writes each step's Iteration into ``environ`` (default ``os.environ``) as the module docstring
    says; ``dagger`` False (a recipe without DAgger) leaves the β and t_max variables alone."""

    def __init__(self, environ: MutableMapping[str, str] | None = None, dagger: bool = True):
        self.environ, self.dagger = environ, dagger

    def published(self, kind: StepKind, iteration: Iteration) -> None:
        env = os.environ if self.environ is None else self.environ
        if kind is StepKind.ROLLOUT:
            env.update(env_values(iteration, self.dagger))
            return
        if not self.dagger:
            return
        env.pop(ENV_BETA, None)
        if env.get(ENV_EVAL_BETA, "").strip():
            env[ENV_BETA] = repr(float(iteration.beta))
