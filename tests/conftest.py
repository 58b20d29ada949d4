import asyncio
import contextlib
import os
import socket
from pathlib import Path

import pytest

from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.record import AbortReason, AbortRecord, EpisodePhase, EpisodeRecord, TerminationReason

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # ray, where used, on 127.0.0.1 only


def run(coro):
    return asyncio.run(coro)


def ended(reason=None, turns=None, **kw):
    """The record of an episode that ended for ``reason``: an abort's reason makes an abort record,
    an agent's is its termination reason."""
    if reason in set(AbortReason):
        abort = AbortRecord(AbortReason(reason), EpisodePhase.RUN, [0.0, 0.0], 0.0, None, [], turns or 0, "test")
        return EpisodeRecord(turns=turns, abort=abort, **kw)
    return EpisodeRecord(turns=turns, termination_reason=None if reason is None else TerminationReason(reason), **kw)


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
    127.0.0.1 only, with Ray's token authentication on (a throwaway token, never ~/.ray's)."""
    ray = pytest.importorskip("ray")
    from rayapp.cli.local_cluster import auth_token

    with auth_token():
        ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, namespace="rayapp-test",
                 logging_level="warning", log_to_driver=False)
        yield ray
        ray.shutdown()


@contextlib.contextmanager
def refuse_network():
    real = socket.socket.connect

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1", "localhost"):
            raise AssertionError(f"network access attempted: {address}")
        return real(sock, address)

    socket.socket.connect = connect
    try:
        yield
    finally:
        socket.socket.connect = real


@pytest.fixture(scope="session")
def cache_dir(request, tmp_path_factory) -> Path:
    if os.environ.get("RAYAPP_CACHE"):
        return Path(os.environ["RAYAPP_CACHE"])
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider (the SGLang lane)
    return cache.mkdir("rayapp-cache") if cache else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def model_dir(cache_dir) -> Path:
    with refuse_network():  # session fixtures set up before the module's guard: the build is checked too
        from rayapp.inference.tiny_model import ensure_tiny_model

        return ensure_tiny_model(cache_dir)


@pytest.fixture(scope="session")
def tok(model_dir):
    """The tiny model's tokenizer (the real one the hf engine serves)."""
    from rayapp.inference.tiny_model import load_tokenizer

    return load_tokenizer(model_dir)


def pytest_collection_modifyitems(config, items):
    """How `make test` spreads the files over pytest-xdist's workers (``--dist loadgroup``): each file whole
    on one worker (its module fixtures set up once), and every file that uses the session's local Ray on
    the same worker, one after the other, as a plain run has them (side by side, one file's pool service
    would meet another's on the shared cluster)."""
    on_ray = {item.path for item in items if "ray_session" in getattr(item, "fixturenames", ())}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("ray" if item.path in on_ray else str(item.path)))
