"""Environments by name, as recipes refer to them: each makes a data source and verifies answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayapp.envs import arithmetic


@dataclass(frozen=True)
class Env:
    make_source: Callable[..., Any]  # (DatasetConfig, name) -> a data source with get_tasks(n)
    verify: Callable[..., dict[str, float]]  # (sample, agent_result) -> reward dict


def _arithmetic_source(cfg: Any, name: str) -> arithmetic.ArithmeticSource:
    return arithmetic.ArithmeticSource(cfg.seed, cfg.task_type or "arithmetic", cfg.n_samples_per_prompt, name,
                                       cfg.dataset_cfg)


ENVS: dict[str, Env] = {"arithmetic": Env(_arithmetic_source, arithmetic.verify)}


def get_env(name: str) -> Env:
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name]
