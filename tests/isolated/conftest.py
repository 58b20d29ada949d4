"""The shared Ray head of the isolated files (``shared_head.py`` says what it is)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from shared_head import USER_CODE, Head

from rayapp.cli import LOCAL_ENV, ROOT, free_port
from rayapp.cli.local_cluster import auth_token, start_head, stop_cluster

EXIT_STATUS = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def head(tmp_path_factory, cache_dir) -> Iterator[Head]:
    saved = dict(os.environ)
    modules = tmp_path_factory.mktemp("modules")
    os.environ.update(LOCAL_ENV)
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # noqa: SIM112 (Ray's own name): fresh metrics
    os.environ["RAYAPP_CACHE"] = str(cache_dir)  # replicas keep tokenizer files there, not in the checkout
    os.environ["PYTHONPATH"] = os.pathsep.join([*map(str, USER_CODE), str(modules), str(ROOT),
                                                *filter(None, [saved.get("PYTHONPATH")])])
    temp_dir = Path(f"/tmp/rayapp-isolated-{os.getpid()}")
    dashboard_port = free_port()
    try:
        with auth_token(), open(tmp_path_factory.mktemp("head") / "ray-start.log", "w") as log:
            address = start_head(4, 8, temp_dir, dashboard_port, log)
            try:
                yield Head(address, temp_dir, free_port(), dashboard_port, modules)
            finally:
                left = stop_cluster(temp_dir)
                assert left == [], f"Ray processes left after the isolated files: {left}"
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config.stash[EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown: after several Ray drivers in this one process (a
    ``ray.init``/``shutdown`` per file), a thread Ray's core worker left behind crashed it at exit
    (SIGSEGV after every test had passed, the summary's last line lost with the buffered output)."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter._tw.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash.get(EXIT_STATUS, 1))
