"""``rayapp run``, ``rayapp demo`` and ``rayapp init``: a recipe end to end on this machine.

``run`` checks the recipe first (``rayapp validate``): ``serve run`` of a config file whose build
fails logs the error and keeps waiting, so a broken recipe must stop here, in seconds, before a
cluster starts. Then it starts a Ray head on 127.0.0.1 with logical GPUs and Ray's token
authentication, with a fresh token that only this user can read (or uses ``--address``),
runs ``serve run <recipe>`` on it, waits for the application, runs the training driver
(``recipes/driver.py``, shipped with the package) with the options given after ``--``, and stops
everything it started. ``demo`` is ``run`` of the embedded default with the tiny CPU model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rayapp.cli.check import validate
from rayapp.cli.local_cluster import LOCAL_ENV, ROOT, free_port, local_app
from rayapp.recipe.load import recipe_document

HERE = Path(__file__).resolve().parent
RECIPES = HERE / "recipes"  # the checkout's recipes/ (a link there), shipped as package data
LAYOUTS = HERE / "layouts"  # the checkout's cluster/layouts/, likewise
DRIVER = RECIPES / "driver.py"


def shipped_recipes() -> list[str]:
    return sorted(p.parent.name for p in RECIPES.glob("*/rollout.yaml"))


def resolve_recipe(arg: str) -> Path:
    """``arg`` as a file when one exists there, a folder's ``rollout.yaml`` (``examples/wordplay``); else a
    shipped recipe, by name (``local``) or by its path in a checkout (``recipes/local/rollout.yaml``); else
    ``arg`` as given, for the error."""
    path = Path(arg)
    if path.is_dir():  # the file named there, missing or not: the error then names the path tried
        return path / "rollout.yaml"
    if path.exists() or path.is_absolute():
        return path
    for shipped in (RECIPES / arg / "rollout.yaml", HERE / path):
        if path.parts and path.parts[0] != ".." and shipped.is_file():
            return shipped
    return path


def _run_app(recipe: Path, args: argparse.Namespace, driver_args: list[str], cwd: Path,
             driver_timeout_s: float | None) -> int:
    temp_dir = Path(args.temp_dir or f"/tmp/rayapp-run-{os.getpid()}")
    serve_log = temp_dir.parent / f"{temp_dir.name}-serve.log"
    dashboard_port = free_port()
    t0 = time.monotonic()
    # Deployed with its dataset paths made absolute against its folder, as validate read them.
    deployed = temp_dir.parent / f"{temp_dir.name}-recipe.yaml"
    deployed.write_text(yaml.safe_dump(recipe_document(recipe)[0], sort_keys=False))
    own_head = getattr(args, "address", None) is None
    print(f"logs: {serve_log} (ray start, serve run: Ray's, Serve's and the replicas' lines)"
          + (f", Ray's own under {temp_dir}/session_latest/logs" if own_head else "")
          + ("; shown here too (--verbose)" if args.verbose else "; --verbose shows them here"), flush=True)
    with local_app(deployed, temp_dir, serve_log, num_gpus=args.num_gpus, num_cpus=args.num_cpus,
                   dashboard_port=dashboard_port, timeout_s=args.timeout, cwd=cwd,
                   address=getattr(args, "address", None), verbose=args.verbose) as (address, _):
        where = (f"ray head at {address} with {args.num_gpus} logical GPUs; dashboard http://127.0.0.1:{dashboard_port}"
                 f" (placement groups: /#/cluster, API /api/v0/placement_groups; its token: the file "
                 f"{os.environ.get('RAY_AUTH_TOKEN_PATH')})"
                 if own_head else f"ray cluster at {address}")
        print(where, flush=True)
        print(f"serve app running ({time.monotonic() - t0:.1f}s after start)", flush=True)
        t1 = time.monotonic()
        # --verbose: Ray's and Serve's lines of the driver's own process (the replicas' come through serve run)
        cmd = [sys.executable, str(DRIVER), f"--address={address}", *(["--verbose"] if args.verbose else []),
               *driver_args]
        code = subprocess.run(cmd, timeout=driver_timeout_s).returncode
        print(f"driver done in {time.monotonic() - t1:.1f}s (exit {code})", flush=True)
    return code


def run(args: argparse.Namespace, driver_args: list[str]) -> int:
    recipe = resolve_recipe(args.recipe)
    if validate(recipe) != 0:
        return 2
    if args.address is None:
        os.environ.update(LOCAL_ENV)  # a head of our own: 127.0.0.1, Ray's token auth with a fresh token
    # No bound on the driver as a whole: it bounds each step itself (its --timeout, ours unless given after --).
    steps = driver_args or ["--rollouts", "1", "--eval"]
    return _run_app(recipe, args, ["--timeout", str(args.timeout), *steps], Path.cwd(), None)


# What the demo's numbers mean: printed after its steps, since the tiny model solves few of its tasks.
TINY_MODEL_NOTE = """\
what the tiny model can and cannot do (it only ever answers "The answer is N."):
  solves:  math-read (the chat picked up after the calculator answered: it reads the result back)
  cannot:  arith-a, arithmetic and math (it does no arithmetic itself: right by luck, or when it calls the
           calculator, about one prompt in ten), humaneval (it writes no code), swe (it fixes no repository);
           arith-cut is cut at 2 new tokens on purpose (the max_context class). Their verifiers work:
           `rayapp verify local` scores each one's reference answers."""


def demo(args: argparse.Namespace) -> int:
    recipe = resolve_recipe(args.recipe)
    if validate(recipe) != 0:  # a broken recipe stops here, before a cluster starts (serve run would wait)
        return 2
    os.environ.update(LOCAL_ENV)
    from rayapp.envs.tiny_model_recipe import TRAINING
    from rayapp.inference.tiny_model import ensure_tiny_model

    t0 = time.monotonic()
    print(f"tiny model ready at {ensure_tiny_model(training=TRAINING)} ({time.monotonic() - t0:.1f}s)", flush=True)
    args.temp_dir = args.temp_dir or f"/tmp/rayapp-demo-{os.getpid()}"
    code = _run_app(recipe, args, ["--rollouts", str(args.rollouts), "--eval"], ROOT, args.timeout)
    if Path(recipe).resolve() == (RECIPES / "local" / "rollout.yaml").resolve():
        print(TINY_MODEL_NOTE, flush=True)
    return code


def init(args: argparse.Namespace) -> int:
    """Write the shipped recipe ``args.recipe`` to ``<dir>/rollout.yaml``, with the layout file it
    names (a relative path, read against the directory ``serve run`` starts in) under ``<dir>``."""
    source = RECIPES / args.recipe / "rollout.yaml"
    if not source.is_file():
        print(f"no shipped recipe {args.recipe!r}; shipped: {', '.join(shipped_recipes())}", file=sys.stderr)
        return 2
    dest_dir = Path(args.dir)
    writes = {dest_dir / "rollout.yaml": source}
    (app,) = [a for a in yaml.safe_load(source.read_text())["applications"] if "args" in a]
    layout = (app["args"].get("pool") or {}).get("cluster_layout")
    if isinstance(layout, str) and not Path(layout).is_absolute() and (LAYOUTS / Path(layout).name).is_file():
        writes[dest_dir / layout] = LAYOUTS / Path(layout).name
    existing = [str(p) for p in writes if p.exists()]
    if existing and not args.force:
        print(f"not overwriting {', '.join(existing)} (--force to)", file=sys.stderr)
        return 2
    for dest, src in writes.items():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        print(f"wrote {dest}")
    print(f"next: rayapp validate {dest_dir / 'rollout.yaml'}   then: rayapp run {dest_dir / 'rollout.yaml'}"
          + (f"   (from {dest_dir}, where the layout path resolves)" if len(writes) > 1 else ""))
    return 0
