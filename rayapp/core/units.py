"""Integer units for the placement pool, and how many tokens of one demand fit in a budget.

All pool arithmetic is in integer units (GPU 1.0 = 1_000_000, CPU in milli-cores, memory in MiB),
so sums are exact and releasing every token restores the initial state exactly. A positive demand
never rounds down to zero: that would make it free.
"""

from __future__ import annotations

import math
import sys

from rayapp.types import Resource

GPU_UNIT = 1_000_000  # one whole GPU
CPU_UNIT = 1_000  # milli-cores per core
MEM_UNIT = 1_024  # MiB per GB
UNBOUNDED = sys.maxsize  # "no limit" for token counts


class PoolError(ValueError):
    """A bad request or a bad release; the pool is unchanged."""


def units_of(value: object, scale: int, what: str, *, allow_inf: bool = False) -> int:
    """``value`` in integer units; a positive demand never rounds down to zero (that would make it
    free). ``+inf`` (budgets only) maps to UNBOUNDED."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PoolError(f"{what}: expected a number, got {value!r}")
    if math.isnan(value) or value < 0:
        raise PoolError(f"{what}: must be a finite number >= 0, got {value!r}")
    if math.isinf(value):
        if allow_inf:
            return UNBOUNDED
        raise PoolError(f"{what}: must be finite, got {value!r}")
    return to_units(value, scale, what)


def to_units(value: float, scale: int, what: str = "amount") -> int:
    """A finite amount >= 0 already checked (a layout's, by the layout parser) in integer units; one so
    large that its units overflow a float (1e308 CPUs) is a PoolError, not a bare OverflowError."""
    scaled = value * scale
    if math.isinf(scaled):
        raise PoolError(f"{what}: too large, got {value!r}")
    return max(1, round(scaled)) if value > 0 else 0


def count_of(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PoolError(f"{what}: expected an integer >= 0, got {value!r}")
    return value


def demand_of(per_sample: Resource) -> tuple[int, int, int, int, float]:
    """``(gpu units on each GPU, number of GPUs, cpu units, memory units, Token.gpu)``; gpu=1.0 is
    one whole GPU either way (k=1 at full units), gpu=0 takes no GPU (k=0)."""
    if not isinstance(per_sample, Resource):
        raise PoolError(f"per_sample: expected a Resource, got {type(per_sample).__name__}")
    gpu = per_sample.gpu
    units_of(gpu, GPU_UNIT, "per_sample.gpu")
    count_of(per_sample.concurrency, "per_sample.concurrency")
    cpu = units_of(per_sample.cpu, CPU_UNIT, "per_sample.cpu")
    mem = units_of(per_sample.memory_gb, MEM_UNIT, "per_sample.memory_gb")
    if gpu == 0:
        return 0, 0, cpu, mem, 0.0
    if gpu <= 1:  # a share of one GPU (1.0 is a whole one)
        return max(1, round(gpu * GPU_UNIT)), 1, cpu, mem, float(gpu)
    if gpu != int(gpu):
        raise PoolError(f"per_sample.gpu: above 1 it must be a whole number of GPUs, got {gpu!r}")
    return GPU_UNIT, int(gpu), cpu, mem, 1.0


def budget_tokens(budget: Resource, per_sample: Resource) -> int:
    """How many ``per_sample`` tokens fit in ``budget``: the least, over every field that
    ``per_sample`` needs, of ``floor(budget / per_sample)`` in integer units (so 0.33 x 3 fits in
    0.99). UNBOUNDED when ``per_sample`` needs nothing."""
    u, k, cpu, mem, _ = demand_of(per_sample)
    if not isinstance(budget, Resource):
        raise PoolError(f"budget: expected a Resource, got {type(budget).__name__}")
    have = (
        units_of(budget.gpu, GPU_UNIT, "budget.gpu", allow_inf=True),
        count_of(budget.concurrency, "budget.concurrency"),
        units_of(budget.cpu, CPU_UNIT, "budget.cpu", allow_inf=True),
        units_of(budget.memory_gb, MEM_UNIT, "budget.memory_gb", allow_inf=True),
    )
    n = UNBOUNDED
    for h, need in zip(have, (u * k, per_sample.concurrency, cpu, mem), strict=True):
        if need > 0 and h != UNBOUNDED:
            n = min(n, h // need)
    return n
