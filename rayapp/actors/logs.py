"""rayapp's log lines inside Serve replicas follow Serve's ``logging_config``.

Serve configures its own logger (``ray.serve``) in each replica from the deployment's or the
application's ``logging_config``: its level, its file under the session's ``logs/serve/`` (with the
replica's name), and its encoding (``encoding: JSON`` writes JSON lines with the replica and
request context). ``follow_serve_logging()``, called in a replica's constructor, hands the
``rayapp`` loggers the same handlers and level, so that a user sets logging once, for both.
"""

from __future__ import annotations

import logging

SERVE_LOGGER = "ray.serve"


def follow_serve_logging() -> None:
    """Route the ``rayapp`` loggers of this process through Serve's handlers, at Serve's level."""
    serve = logging.getLogger(SERVE_LOGGER)
    if not serve.handlers:  # not in a replica (a test, a driver): leave logging as it is
        return
    ours = logging.getLogger("rayapp")
    ours.handlers = list(serve.handlers)
    ours.setLevel(serve.level)
    ours.propagate = False
