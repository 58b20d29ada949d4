"""Bounded remote calls: every await across a process boundary goes through ``bounded``.

``bounded`` awaits a Ray ``ObjectRef`` or a Serve ``DeploymentResponse`` for at most a given time.
When the caller stops waiting (the bound passed, or the caller was cancelled) it cancels the call,
so no remote work runs on for nobody. It then turns Ray's failures into what the core classifies
(``rayapp.core.termination``): the callee's own exception comes back as itself (a remote task's
error as its cause); a lost callee (its actor, worker or node died, its group was removed, Serve
shed the request) becomes the caller's ``lost`` error, and a timeout its ``late`` error. Each call
site names its errors, since what was lost (an engine, a sandbox, a bundle) decides the class.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray
from ray import exceptions as rex
from ray.serve.exceptions import BackPressureError

log = logging.getLogger(__name__)

# A callee that is gone, not one that failed: its actor, worker or node died, its bundle's group was
# removed, or Serve refused the request.
LOST = (rex.RayActorError, rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError,
        rex.TaskPlacementGroupRemoved, BackPressureError)
_LOST_WORDS = ("unavailable", "died")  # other Ray errors that say the same in words


def is_lost(error: BaseException) -> bool:
    """Whether ``error`` says the callee is gone (by type, else by a Ray error's message)."""
    if isinstance(error, LOST):
        return True
    return isinstance(error, rex.RayError) and any(w in str(error).lower() for w in _LOST_WORDS)


def cancel(pending: Any, *, force: bool = False) -> None:
    """Cancel a call: a Serve response cancels itself (Serve routes it to the replica); an
    ObjectRef's task is cancelled through Ray (``force`` kills a plain task's worker; actor tasks
    only take the plain cancel). Best effort: a call that already ended ignores it."""
    try:
        if isinstance(pending, ray.ObjectRef):
            ray.cancel(pending, force=force)
        else:
            pending.cancel()
    except Exception as e:  # the call is over or its owner gone: nothing left to stop
        log.debug("cancelling %r failed: %s", pending, e)


async def bounded(pending: Any, timeout_s: float | None, *, late: Callable[[], Exception] | None = None,
                  lost: Callable[[BaseException], Exception] | None = None, force: bool = False) -> Any:
    """The result of ``pending`` within ``timeout_s`` seconds (None: no bound).

    Timeout or cancellation: the call is cancelled; a timeout raises ``late()`` (default: the
    TimeoutError). A remote task's exception is raised as its cause. A lost callee raises
    ``lost(error)`` chained to Ray's error (default: Ray's error as it is)."""
    try:
        async with asyncio.timeout(timeout_s) as deadline:
            return await pending
    except (TimeoutError, asyncio.CancelledError) as e:
        stopped = isinstance(e, asyncio.CancelledError) or deadline.expired()
        if stopped:
            cancel(pending, force=force)
        if isinstance(e, TimeoutError) and stopped and late is not None:
            raise late() from None
        raise
    except rex.RayTaskError as e:  # the callee ran and raised: its own error, classified by the caller
        raise e.as_instanceof_cause() from None
    except Exception as e:
        if lost is not None and is_lost(e):
            raise lost(e) from e
        raise
