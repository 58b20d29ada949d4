"""A DAgger agent: the roll-in mixes a student and a teacher (two inference deployments) by the
iteration's β and t_max, and every visited state gets the teacher's label.

Per model turn t: within the first t_max turns (all turns when t_max is 0) the teacher acts with
probability β, else the student; after them the student acts alone. The acting model's tokens are
the trajectory. Training targets are the teacher's: its tokens carry loss 1 where it acted; where
the student acted, its tokens carry loss 0 and the teacher's label for that same state (asked of
the teacher with the same context) is kept in the episode record's ``dagger_labels`` (the trainer's
``_dagger_labels``, for its SFT batch). Each turn record names who acted (its ``actor``; the
trainer's ``_turn_actor``). β and t_max come from ``ctx.iteration`` (the scheduler's published
``Iteration``); without one β is 0 (student only). In an eval step (``StepKind.EVAL``) no labels
are asked for. A roll-in cut short resumes like any ToolAgent (partial rollouts), its kept labels
with it.
"""

from __future__ import annotations

import random
from typing import Any

from rayapp.core.clock import loop_time
from rayapp.envs.agents.multiturn import ToolAgent
from rayapp.envs.protocol import Engine
from rayapp.episode import EpisodeContext
from rayapp.inference.client import GenerateOutput, GenerateRequest
from rayapp.record import Actor, DaggerLabel
from rayapp.types import Sample, StepKind


class DAggerRollIn:
    """The roll-in as a mixin over any ToolAgent (``class X(DAggerRollIn, SomeToolAgent)``): it
    replaces the agent's one model turn (``act``); the engine the agent was built with is the
    student. Set ``teacher`` (an engine) and ``seed`` in ``__init__``."""

    teacher: Engine
    seed: int = 0

    def _teacher_acts(self, turn: int, sample: Sample, ctx: EpisodeContext) -> bool:
        beta, t_max = ctx.iteration.beta, ctx.iteration.t_max
        if t_max > 0 and turn > t_max:
            return False
        # seeded per (iteration, sample, turn): the same roll-in replays identically
        rng = random.Random(f"{self.seed}:{ctx.rollout_id}:{sample.task_id}:{sample.index}:{turn}")
        return rng.random() < beta

    async def act(self, req: GenerateRequest, turn: int, sample: Sample,
                  ctx: EpisodeContext) -> tuple[GenerateOutput, int]:
        started = loop_time()
        if self._teacher_acts(turn, sample, ctx):
            out = await self.teacher.generate(req)
            ctx.record_turn(turn, out.engine, Actor.TEACHER, engine_s=loop_time() - started,
                             weight_version=out.weight_version)
            return out, 1
        out = await self.engine.generate(req)
        engine_s = loop_time() - started  # the student's own call: the label below is the teacher's time
        if ctx.step != StepKind.EVAL:  # labels are training data: an eval step would pay the teacher for nothing
            label = await self.teacher.generate(req)  # the expert's action in the state the student reached
            ctx.record.add_label(DaggerLabel(turn, len(req.input_ids), list(label.output_ids), label.text))
        ctx.record_turn(turn, out.engine, Actor.STUDENT, engine_s=engine_s, weight_version=out.weight_version)
        return out, 0


class DAggerAgent(DAggerRollIn, ToolAgent):
    """A ToolAgent whose turns follow the DAgger roll-in. Cut short (partial rollouts), it goes on from
    its last complete turn: the kept turns' teacher labels travel in its ResumePoint; the turns after
    it are drawn afresh by the step that runs them (the choice is seeded per step), as a new roll-in's."""

    def __init__(self, student: Engine, teacher: Engine, verify: Any, *, seed: int = 0, **kw: Any):
        super().__init__(student, verify, **kw)
        self.teacher, self.seed = teacher, seed
