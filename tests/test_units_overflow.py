"""Integer units: an amount so large that its units overflow a float is a PoolError, never a bare
OverflowError, wherever it enters the pool's arithmetic."""

import pytest

from rayapp.core.units import CPU_UNIT, GPU_UNIT, UNBOUNDED, PoolError, budget_tokens, demand_of, to_units, units_of
from rayapp.types import Resource


@pytest.mark.parametrize("call", [
    lambda: units_of(1e308, CPU_UNIT, "x"),
    lambda: to_units(1.7e308, CPU_UNIT),
    lambda: demand_of(Resource(gpu=1e308)),
    lambda: demand_of(Resource(cpu=1e308)),
    lambda: demand_of(Resource(memory_gb=1e308)),
    lambda: budget_tokens(Resource(gpu=1e308), Resource(gpu=0.5)),
    lambda: budget_tokens(Resource(cpu=1e308), Resource(cpu=1)),
])
def test_an_overflowing_amount_is_a_pool_error(call) -> None:
    with pytest.raises(PoolError, match="too large"):
        call()


def test_the_largest_amounts_that_fit_still_count() -> None:
    assert to_units(1e300, CPU_UNIT) == round(1e300 * CPU_UNIT)
    whole = Resource(gpu=1.0, concurrency=0)
    assert budget_tokens(Resource(gpu=1e300), whole) == min(UNBOUNDED, round(1e300 * GPU_UNIT) // GPU_UNIT)
