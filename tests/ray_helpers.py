"""Pool services for the tests on the session's local Ray: started and stopped so that the next test never
meets this one's. ``ray.kill`` only asks for the kill, and a pool service refuses to start beside a live
one, so a stop waits until the actor is gone; a start waits long enough for a worker process to boot on a
loaded machine (the first call is the actor's start)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

START_S = 180  # a worker process's start and the service's placement groups, on a loaded 2-core machine
STOP_S = 60


def stop(ray: Any, actor: Any) -> None:
    """Kill ``actor`` and wait until Ray reports it dead."""
    ray.kill(actor)
    deadline = time.monotonic() + STOP_S
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"actor still alive {STOP_S} s after ray.kill")


@contextlib.contextmanager
def pool_service(ray: Any, layout: str | None, pg_ready_timeout_s: float = 30.0, **options: Any) -> Iterator[Any]:
    """A started PlacementPoolService on ``layout``; stopped (and gone) when the block ends."""
    from rayapp.actors.pool_service import PlacementPoolService

    actor = ray.remote(PlacementPoolService).options(num_cpus=0, **options).remote(
        layout, pg_ready_timeout_s=pg_ready_timeout_s)
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=START_S)
        yield actor
    finally:
        stop(ray, actor)
