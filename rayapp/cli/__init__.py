"""The ``rayapp`` command line.

- ``rayapp --version``;
- ``rayapp validate <recipe>``: the recipe and Ray Serve's schema of the file, offline (no Ray
  started): ``OK``, or each problem by JSON path (exit status 2);
- ``rayapp verify <recipe> [--dataset NAME] [--responses FILE] [--limit N]``: each dataset's rows
  through its verifier with the reference answers (or given responses), offline (no Ray, no engine):
  the scores per dataset; exit status 1 when reference answers score 0 (``rayapp.cli.verify``);
- ``rayapp schema [--serve-config]``: the recipe's JSON Schema (or the whole file's), for editors;
- ``rayapp init [dir]``: a shipped recipe written to ``dir/rollout.yaml``;
- ``rayapp run <recipe> [--verbose] [-- driver options]``: validate, a local Ray head, ``serve run``, the
  driver; Ray's and Serve's lines go to the run's log (``--verbose``: to the terminal too);
- ``rayapp try <recipe> [--rollouts N] [--eval] [--json FILE]``: the recipe's steps in this one process,
  without Ray (hf engines in process), printing the samples a trainer would get (``rayapp.cli.try_recipe``);
- ``rayapp driver [-- driver options]``: the shipped training driver against a running app;
- ``rayapp demo [--verbose]``: ``run`` of the embedded default with the tiny CPU model.

A recipe is a file path, a folder (its ``rollout.yaml``) or the name of a shipped recipe (``local``,
``dagger_local``, ``swe_dagger``, ``grpo_sglang``).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata

from rayapp.cli.check import schema, validate
from rayapp.cli.launch import DRIVER, demo, init, resolve_recipe, run, shipped_recipes
from rayapp.cli.local_cluster import (
    LOCAL_ENV,
    LOCAL_ENV_WHY,
    ROOT,
    _bin,
    free_port,
    local_app,
    ray_processes,
    start_head,
    stop_cluster,
    wait_for_app,
)

__all__ = ["LOCAL_ENV", "LOCAL_ENV_WHY", "ROOT", "_bin", "build_parser", "demo", "free_port", "init", "local_app",
           "main", "ray_processes", "resolve_recipe", "run", "shipped_recipes", "start_head", "stop_cluster",
           "validate", "version", "wait_for_app"]

RECIPE_HELP = "a recipe file, a folder holding rollout.yaml, or the name of a shipped recipe"
VERBOSE_HELP = ("Ray's and Serve's own lines on the terminal too (ray start, serve run, the replicas, the driver's "
                "Serve router); without it they go only to the run's log, <temp-dir>-serve.log")


def version() -> str:
    def of(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"rayapp {of('rayapp')} (ray {of('ray')}, python {sys.version.split()[0]})"


def _local_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-gpus", type=int, default=4, help="logical GPUs of the local Ray head")
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray head")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the app to start, and for each step")
    p.add_argument("--temp-dir", default=None, help="Ray's session folder (default: /tmp/rayapp-run-<pid>)")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayapp", description="rayapp command line")
    p.add_argument("--version", action="version", version=version())
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="the embedded default end to end: local head, serve run, the driver, stop")
    d.add_argument("--recipe", default="recipes/local/rollout.yaml",
                   help="the Serve config to run; a relative path not found here is taken from the checkout")
    d.add_argument("--num-gpus", type=int, default=4, help="logical GPUs of the local Ray head")
    d.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray head")
    d.add_argument("--rollouts", type=int, default=1, help="iterations the driver runs: rollout k, then eval k")
    d.add_argument("--timeout", type=float, default=900.0, help="seconds for the app to start, and for each step")
    d.add_argument("--temp-dir", default=None, help="Ray's session folder (default: /tmp/rayapp-demo-<pid>)")
    d.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    v = sub.add_parser("validate", help="check a recipe and Serve's schema of its file offline (no Ray)")
    v.add_argument("recipe", help=RECIPE_HELP + "; a Serve config whose rayapp application's args are the recipe, "
                                                "or bare args")
    v.add_argument("--plugin-timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds each plug-in import or call may take (default: RAYAPP_PLUGIN_TIMEOUT_S, else 60)")
    vf = sub.add_parser("verify", help="score each dataset's rows with its verifier, the reference answers (or "
                                       "given responses) as the response, offline (no Ray, no engine)")
    vf.add_argument("recipe", help=RECIPE_HELP)
    vf.add_argument("--dataset", default=None, help="only this dataset (its name, or data/NAME, eval/NAME)")
    vf.add_argument("--responses", default=None, metavar="FILE",
                    help='a JSONL file of {"task_id": ..., "response": ...} (optional "dataset") to score instead')
    vf.add_argument("--limit", type=int, default=None,
                    help="rows per dataset (default: an eval dataset's n_prompts, a rollout dataset's all)")
    s = sub.add_parser("schema", help="print the recipe's JSON Schema (from its msgspec types)")
    s.add_argument("--serve-config", action="store_true",
                   help="the schema of a whole recipe file: Serve's config schema with the recipe as the args")
    i = sub.add_parser("init", help="write a shipped recipe to <dir>/rollout.yaml")
    i.add_argument("dir", nargs="?", default=".", help="where to write it (default: here)")
    i.add_argument("--recipe", default="local", help="which shipped recipe (default: local)")
    i.add_argument("--force", action="store_true", help="overwrite files that exist")
    r = sub.add_parser("run", help="validate, then a local Ray head, serve run and the driver; "
                                   "driver options after --")
    r.add_argument("recipe", help=RECIPE_HELP)
    r.add_argument("--address", default=None,
                   help="a running Ray cluster to deploy on instead of starting a local head")
    _local_head_args(r)
    from rayapp.cli.try_recipe import add_parser as add_try

    add_try(sub, RECIPE_HELP)
    sub.add_parser("driver", help="the shipped training driver (recipes/driver.py) against a running app; "
                                  "its options after --")
    return p


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after `--` goes to the driver unread (its own flags: --rollouts, --eval, --timeout, ...).
    driver_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.cmd == "validate":
        if args.plugin_timeout is not None:
            if not 0 < args.plugin_timeout < float("inf"):
                build_parser().error(f"--plugin-timeout {args.plugin_timeout:g}: expected a positive number of seconds")
            from rayapp.envs.plugin_import import TIMEOUT_ENV

            os.environ[TIMEOUT_ENV] = str(args.plugin_timeout)  # read by the checks' child process too
        sys.exit(validate(resolve_recipe(args.recipe)))
    if args.cmd == "verify":
        from rayapp.cli.verify import verify

        sys.exit(verify(resolve_recipe(args.recipe), args.dataset, args.responses, args.limit))
    if args.cmd == "try":
        from rayapp.cli.try_recipe import try_recipe

        sys.exit(try_recipe(resolve_recipe(args.recipe), args))
    if args.cmd == "schema":
        sys.exit(schema(args.serve_config))
    if args.cmd == "init":
        sys.exit(init(args))
    if args.cmd == "driver":
        os.execv(sys.executable, [sys.executable, str(DRIVER), *driver_args])
    try:
        sys.exit(run(args, driver_args) if args.cmd == "run" else demo(args))
    except (RuntimeError, TimeoutError) as e:
        # A cluster or app that did not come up: its own message (the cause and the log's path) is the
        # news, not our call stack; --verbose keeps the traceback.
        if args.verbose:
            raise
        print(f"rayapp {args.cmd}: {e}", file=sys.stderr)
        sys.exit(1)
