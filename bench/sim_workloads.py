"""The simulator's inputs: seeded workloads of long-tailed episodes, and cluster layouts.

A workload is a list of tasks (groups of ``GROUP`` samples at ``PER_SAMPLE``); each sample is a
list of turns (engine seconds, tool seconds) and a verify time. Episode times are drawn per task
(its difficulty) times per sample (the group's spread), so that a task's length can be estimated
at all: ``expected_len`` is the group's true mean times lognormal noise, never the truth.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from rayapp.types import NodeSpec, Resource

GROUP = 8  # samples per task (GRPO group)
GPUS_PER_NODE = 8
PER_SAMPLE = Resource(gpu=0.25, cpu=1, memory_gb=4)  # one running sample: a quarter GPU
SLOTS_PER_NODE = int(GPUS_PER_NODE / PER_SAMPLE.gpu)


@dataclass(frozen=True, slots=True)
class SampleTrace:
    turns: tuple[tuple[float, float], ...]  # (engine seconds, tool seconds) per model turn
    verify_s: float

    @property
    def duration(self) -> float:
        """Seconds the sample holds its token: every turn, then verify."""
        return sum(e + t for e, t in self.turns) + self.verify_s


@dataclass(frozen=True, slots=True)
class TaskTrace:
    task_id: str
    samples: tuple[SampleTrace, ...]
    expected_len: float  # a noisy estimate, as a length predictor would give


def layout(nodes: int) -> dict[str, NodeSpec]:
    """``nodes`` x 8 GPUs; CPU and memory never bind before the GPUs do at ``PER_SAMPLE``."""
    if nodes < 1:
        raise ValueError(f"nodes: expected >= 1, got {nodes}")
    return {f"n{i}": NodeSpec(gpus=tuple(range(GPUS_PER_NODE)), cpu=128, memory_gb=1024) for i in range(nodes)}


def _single(seconds: float, verify_s: float) -> SampleTrace:
    return SampleTrace(((seconds, 0.0),), verify_s)


def _lognormal(rng: random.Random) -> Callable[[], list[SampleTrace]]:
    """Median 20 s, sigma 1.1 overall: task difficulty sigma 0.8, the group's spread the rest."""
    s_task, s_sample = 0.8, math.sqrt(1.1**2 - 0.8**2)

    def group() -> list[SampleTrace]:
        median = 20.0 * rng.lognormvariate(0, s_task)
        return [_single(median * rng.lognormvariate(0, s_sample), 0.5 * rng.lognormvariate(0, 0.3))
                for _ in range(GROUP)]

    return group


def _bimodal(rng: random.Random) -> Callable[[], list[SampleTrace]]:
    """70% easy tasks (median 8 s), 30% hard ones (median 120 s); a tight spread in each."""

    def group() -> list[SampleTrace]:
        median = 120.0 if rng.random() < 0.3 else 8.0
        return [_single(median * rng.lognormvariate(0, 0.4), 0.5 * rng.lognormvariate(0, 0.3)) for _ in range(GROUP)]

    return group


def _swe(rng: random.Random) -> Callable[[], list[SampleTrace]]:
    """SWE-style: a Pareto tail (alpha 1.3, from 40 s, cut at the hour), tests as verify (~10 s)."""

    def group() -> list[SampleTrace]:
        base = 40.0 * rng.paretovariate(1.3)
        return [_single(min(3600.0, base * rng.lognormvariate(0, 0.5)), 10.0 * rng.lognormvariate(0, 0.5))
                for _ in range(GROUP)]

    return group


def _multiturn(rng: random.Random) -> Callable[[], list[SampleTrace]]:
    """Tool-using agents: turns geometric around the task's mean (2-12), engine ~2.5 s and tool
    ~1.5 s a turn (the task's difficulty scales both), at most 30 turns."""

    def group() -> list[SampleTrace]:
        mean_turns = rng.uniform(2, 12)
        scale = rng.lognormvariate(0, 0.5)
        out = []
        for _ in range(GROUP):
            n = min(30, 1 + int(rng.expovariate(1 / (mean_turns - 1))))
            turns = tuple((2.5 * scale * rng.lognormvariate(0, 0.6), 1.5 * rng.lognormvariate(0, 0.8))
                          for _ in range(n))
            out.append(SampleTrace(turns, 0.5 * rng.lognormvariate(0, 0.3)))
        return out

    return group


WORKLOADS: dict[str, Callable[[random.Random], Callable[[], list[SampleTrace]]]] = {
    "lognormal": _lognormal,
    "bimodal": _bimodal,
    "swe": _swe,
    "multiturn": _multiturn,
}


def workload(name: str, n_tasks: int, seed: int, *, step: int = 0, noise: float = 0.5) -> list[TaskTrace]:
    """``n_tasks`` tasks of workload ``name`` for rollout step ``step``, the same for the same seed.
    ``noise`` is the sigma of the lognormal error on each task's length estimate."""
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r}: not one of {sorted(WORKLOADS)}")
    rng = random.Random(f"{name}/{seed}/{step}")
    group = WORKLOADS[name](rng)
    tasks = []
    for i in range(n_tasks):
        samples = tuple(group())
        mean = sum(s.duration for s in samples) / len(samples)
        tasks.append(TaskTrace(f"s{step}t{i}", samples, mean * rng.lognormvariate(0, noise)))
    return tasks
