import asyncio
import os

import pytest

from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # ray, where used, on 127.0.0.1 only


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def make_pool():
    """Builds PlacementPools from layouts, and after the test checks that each one is back to its
    exact initial state: every token returned, every capacity restored."""
    made: list[tuple[PlacementPool, dict]] = []

    def factory(layout, default_cpus=8, default_memory_gb=64):
        pool = PlacementPool(parse_cluster_layout(layout, default_cpus, default_memory_gb))
        made.append((pool, pool.snapshot()))
        return pool

    yield factory
    for pool, initial in made:
        assert pool.held == 0, f"{pool.held} tokens still held after the test"
        assert pool.snapshot() == initial


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray per test session (init + shutdown cost seconds): 8 logical CPUs, 4 logical GPUs,
    127.0.0.1 only."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, namespace="rayapp-test",
             logging_level="warning", log_to_driver=False)
    yield ray
    ray.shutdown()
