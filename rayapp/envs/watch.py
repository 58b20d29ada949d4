"""What plug-in code is running now, for whoever watches: ``rayapp validate`` runs a recipe's checks in a
child process (``rayapp.cli.isolate``) and, when that child hangs in a plug-in or ends without a word
(``os._exit``, a signal), names the recipe field and the call from the last thing reported here.

Callers say which recipe field they are checking (``field``) and wrap each call into a user's code
(``running``: an import, ``rows(cfg)``, an agent factory). Without a watcher both cost nothing.
Single-threaded by design: the validate child checks one recipe on one thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

# Called with (JSON path in the recipe, what is running) when plug-in code starts, and with
# (None, None) when none is running any more.
Watcher = Callable[[str | None, str | None], None]
WATCHER: Watcher | None = None
_FIELDS = ["$"]
_RUNNING: list[tuple[str, str]] = []


@contextlib.contextmanager
def field(at: str) -> Iterator[None]:
    """Plug-in code run inside this block is reported as ``at``'s (a JSON path in the recipe's args)."""
    _FIELDS.append(at)
    try:
        yield
    finally:
        _FIELDS.pop()


@contextlib.contextmanager
def running(what: str) -> Iterator[None]:
    """A call into a user's code (``what``: "data source 'm:rows': its rows(cfg)"), reported while it runs."""
    _RUNNING.append((_FIELDS[-1], what))
    _tell()
    try:
        yield
    finally:
        _RUNNING.pop()
        _tell()


def _tell() -> None:
    if WATCHER is not None:
        WATCHER(*(_RUNNING[-1] if _RUNNING else (None, None)))
