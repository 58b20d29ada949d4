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
This module imports Ray only when called: ``import rayapp`` stays Ray-free.
"""

from __future__ import annotations

import logging
from typing import Any

SERVE_LOGGER = "ray.serve"  # Serve's logger name (ray.serve._private.constants.SERVE_LOGGER_NAME)


def quiet_serve_logger(verbose: bool = False) -> None:
    """Serve's logger in this process at WARNING (INFO when ``verbose``): call it after ``import ray.serve``,
    which sets the logger up, and before the first handle is taken."""
    logging.getLogger(SERVE_LOGGER).setLevel(logging.INFO if verbose else logging.WARNING)


def connect(address: str = "auto", app: str = "rayapp", *, namespace: str | None = None, verbose: bool = False,
            worker_logs: bool | None = None) -> Any:
    """``ray.init(address)`` and ``serve.get_app_handle(app)``, quiet unless ``verbose``.
    ``worker_logs`` (default: ``verbose``) streams the replicas' and workers' lines into this process;
    a driver started beside ``serve run`` leaves it off, since ``serve run`` prints them already."""
    import ray
    from ray import serve

    ray.init(address=address, namespace=namespace, logging_level=logging.INFO if verbose else logging.WARNING,
             log_to_driver=verbose if worker_logs is None else worker_logs)
    quiet_serve_logger(verbose)
    return serve.get_app_handle(app)
