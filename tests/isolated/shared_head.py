"""One Ray head for the isolated files: each file deploys its own Serve application on it in turn
(``serve_app``), so the suite pays for one ``ray start`` and one stop instead of one per file.

The head is what ``rayapp run`` starts (127.0.0.1, logical GPUs, Ray's token authentication with a
fresh token), with what every application here needs from its processes' environment set before it
starts: the user packages of the examples on ``PYTHONPATH`` (a user sets it where ``ray start`` runs),
the session's model cache, metrics reported every second. Files that need a Ray of another shape
(a multi-node ``Cluster``, their own ``ray start``) still start their own."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from rayapp.cli import ROOT, local_app

HERE = Path(__file__).resolve().parent
# the user packages of the applications deployed here (importable by the head, its workers and serve run)
USER_CODE = (ROOT / "examples" / "wordplay", ROOT / "examples" / "openai_agent", HERE)


@dataclass(frozen=True)
class Head:
    address: str
    temp_dir: Path
    http_port: int  # Serve's proxy keeps the port of the first application: every config names this one
    dashboard_port: int
    modules: Path  # a folder on the head's PYTHONPATH for modules a test writes


@contextlib.contextmanager
def serve_app(head: Head, cfg: dict, tmp: Path, timeout_s: float = 600) -> Iterator[subprocess.Popen]:
    """``serve run`` of ``cfg`` (a Serve config dict) on the shared head, yielding the serve process
    once its application runs; the application is deleted when the block ends (``local_app`` on a
    cluster it did not start), so the next file deploys its own on a clean Serve."""
    cfg["http_options"]["port"] = head.http_port
    recipe = tmp / "rollout.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    with local_app(recipe, head.temp_dir, tmp / "serve.log", timeout_s=timeout_s, address=head.address) as (_, p):
        yield p


def start_serve(head: Head) -> None:
    """Serve on the head with its proxy on the shared port, unless it runs already: an application that
    names another port (a shipped recipe deployed as it is) then leaves the proxy where the others expect it."""
    code = ("import ray, sys; from ray import serve; ray.init(address=sys.argv[1], logging_level='error', "
            "log_to_driver=False); serve.start(http_options={'host': '127.0.0.1', 'port': int(sys.argv[2])})")
    subprocess.run([sys.executable, "-c", code, head.address, str(head.http_port)], capture_output=True,
                   timeout=180, check=True)
