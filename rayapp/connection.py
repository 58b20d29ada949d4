"""A driver's connection to the running app: ``ray.init`` and the application's handle, with Ray's and
Serve's own lines kept off the driver's terminal unless asked for.

    from rayapp import connect
    manager = connect("auto")                   # the "rayapp" application's handle
    manager.generate.remote(0).result(timeout_s=900)

Quiet means: Ray's logger at WARNING (no "Connecting to existing Ray cluster" banner), the replicas'
and workers' lines not streamed into this process (Ray's ``log_to_driver``: a plain ``ray.init``
prints every replica's log lines, Serve's access log ``CALL generate OK 155.5ms`` among them), and
Serve's logger in this process at WARNING (importing ``ray.serve`` gives it a stderr handler at INFO,
whose first line is the router's ``Started <...SharedRouterLongPollClient object at 0x...>``). The
lines are still written where Ray writes them: the session's ``logs/`` folder (``logs/serve/`` for
Serve's components and replicas), and ``serve run``'s output. ``verbose=True`` keeps Ray's defaults.

A driver started right after ``serve run`` would meet Serve's "application does not exist" or
``DeploymentUnavailableError`` at once: ``connect`` (and the trainer adapters, through ``manager_handle``)
first waits for the manager deployment, bounded, saying its state as it changes.
This module imports Ray only when called: ``import rayapp`` stays Ray-free.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SERVE_LOGGER = "ray.serve"  # Serve's logger name (ray.serve._private.constants.SERVE_LOGGER_NAME)
MANAGER = "SchedulerRolloutManager"  # the rayapp application's ingress deployment (rayapp.actors.app)
WAIT_S = 300.0  # how long a driver waits for the manager by default: a deploy takes about a minute on 2 cores
# Pauses between looks while Serve cannot route to a deployment yet (a replica starts in seconds to a minute).
UNAVAILABLE_PAUSES_S = (0.5, 1.0, 2.0, 5.0)
READY = ("HEALTHY", "UPSCALING", "DOWNSCALING")  # a deployment's states with a running replica to route to


def next_pause(tries: int, left_s: float, pauses: tuple[float, ...] | None = None) -> float | None:
    """The pause after ``tries`` refusals of a call Serve cannot route yet, or None when it would end
    past the bound (``left_s`` seconds from now): the caller then fails instead of waiting."""
    pauses = pauses or UNAVAILABLE_PAUSES_S
    pause = pauses[min(tries, len(pauses) - 1)]
    return None if pause >= left_s else pause


def serve_status(timeout_s: float = 60.0) -> Any:
    """``serve.status()`` of the cluster this process is connected to, bounded: it asks Serve's
    controller, which may be busy starting the application."""
    from ray import serve

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayapp-serve-status")
    try:
        return pool.submit(serve.status).result(timeout=timeout_s)
    except TimeoutError:
        raise TimeoutError(f"Serve's controller did not answer serve.status() within {timeout_s:g}s") from None
    finally:
        pool.shutdown(wait=False)


def _value(state: Any) -> str:
    return str(getattr(state, "value", state))


def manager_state(status: Any, app: str, deployment: str = MANAGER) -> tuple[bool, str]:
    """(whether Serve can route to the manager of ``app`` now, its state in words) from a
    ``serve.status()`` answer. An application that runs has every deployment up (any app, whatever
    its ingress is called); a failed one raises at once with Serve's last line about it."""
    overview = status.applications.get(app)
    if overview is None:
        return False, "no such application yet"
    if _value(overview.status) == "RUNNING":
        return True, "RUNNING"
    found = overview.deployments.get(deployment)
    if found is not None and _value(found.status) in READY:
        return True, _value(found.status)
    failed = _value(overview.status) == "DEPLOY_FAILED" or (found is not None and
                                                            _value(found.status) == "DEPLOY_FAILED")
    if failed:
        said = [line.strip() for line in "\n".join([overview.message, found.message if found else ""]).splitlines()
                if line.strip()]
        raise RuntimeError(f"the {app} app's manager ({deployment}) will not come up: application "
                           f"{_value(overview.status)}, deployment "
                           f"{_value(found.status) if found else 'not listed'}: {said[-1] if said else 'no message'}")
    if found is None:
        return False, f"application {_value(overview.status)}, {deployment} not deployed yet"
    return False, f"{_value(found.status)} (application {_value(overview.status)})"


def wait_for_manager(app: str = "rayapp", timeout_s: float = WAIT_S, *, deployment: str = MANAGER,
                     status: Callable[[], Any] | None = None, say: Callable[[str], None] | None = print,
                     sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> None:
    """Until Serve can route to ``app``'s manager deployment (``manager_state``), saying each new state
    ("waiting for the rayapp app's manager: UPDATING (application DEPLOYING) (12 s)"), or, after
    ``timeout_s``, one ``TimeoutError`` naming the app, the deployment and its state. ``status``: where
    ``serve.status()`` answers come from (default: Serve's controller); ``sleep`` and ``clock``: how it
    pauses and reads the time."""
    status = status or serve_status
    started, tries, said = clock(), 0, None
    while True:
        ready, state = manager_state(status(), app, deployment)
        if ready:
            return
        waited = clock() - started
        pause = next_pause(tries, timeout_s - waited)
        if pause is None:
            raise TimeoutError(f"the {app} app's manager ({deployment}) is not up within {timeout_s:g}s: {state}; "
                               "see `serve status`")
        if say is not None and state != said:
            say(f"waiting for the {app} app's manager: {state} ({waited:.0f} s)")
            said = state
        tries += 1
        sleep(pause)


def manager_handle(app: str = "rayapp", timeout_s: float = WAIT_S, *, say: Callable[[str], None] | None = print,
                   status: Callable[[], Any] | None = None) -> Any:
    """``serve.get_app_handle(app)`` once ``wait_for_manager`` says its manager is up."""
    from ray import serve

    wait_for_manager(app, timeout_s, status=status, say=say)
    return serve.get_app_handle(app)


def quiet_serve_logger(verbose: bool = False) -> None:
    """Serve's logger in this process at WARNING (INFO when ``verbose``): call it after ``import ray.serve``,
    which sets the logger up, and before the first handle is taken."""
    logging.getLogger(SERVE_LOGGER).setLevel(logging.INFO if verbose else logging.WARNING)


def connect(address: str = "auto", app: str = "rayapp", *, namespace: str | None = None, verbose: bool = False,
            worker_logs: bool | None = None, timeout_s: float = WAIT_S) -> Any:
    """``ray.init(address)`` and ``app``'s handle once its manager is up (``manager_handle``, waiting at
    most ``timeout_s``), quiet unless ``verbose``. ``worker_logs`` (default: ``verbose``) streams the
    replicas' and workers' lines into this process; a driver started beside ``serve run`` leaves it
    off, since ``serve run`` prints them already."""
    import ray
    from ray import serve  # noqa: F401 (imported before quiet_serve_logger: the import sets Serve's logger up)

    ray.init(address=address, namespace=namespace, logging_level=logging.INFO if verbose else logging.WARNING,
             log_to_driver=verbose if worker_logs is None else worker_logs)
    quiet_serve_logger(verbose)
    return manager_handle(app, timeout_s)
