"""The knob reference (docs/scheduler.md §6), generated from the code's own definitions:

    python -m rayapp.knobs > docs/knobs.md

CLI flags come from the parsers that define them, environment variables from the tables the
modules that read them keep, recipe keys from the recipe's msgspec Structs. A test regenerates the
page and fails when it differs from docs/knobs.md, so code and reference cannot drift apart.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import msgspec

from rayapp import cli
from rayapp.envs.plugin_import import IMPORT_TIMEOUT_S
from rayapp.envs.plugin_import import TIMEOUT_ENV as PLUGIN_TIMEOUT_ENV
from rayapp.recipe import ENV_KNOBS as RECIPE_ENV_KNOBS
from rayapp.recipe import RecipeConfig
from rayapp.recipe.removed import REMOVED
from rayapp.steps import dagger_schedule, reuse

# Environment variables read outside the two tables above.
OTHER_ENV: dict[str, tuple[str, str]] = {
    "RAYAPP_CACHE": ("~/.cache/rayapp", "user-set: where the tiny CPU model is built when the shipped build is "
                                        "missing, and where the manager keeps the tokenizer files engines hand it; "
                                        "an absolute path outside rayapp's package, read by each process (a "
                                        "replica: from its node's ray start, or runtime_env env_vars)"),
    "RAYAPP_CLUSTER": ("", "code-set: the session folder of a Ray head `rayapp run`/`demo` started, in the "
                           "environment of every process of that cluster, so the stop finds each one"),
    PLUGIN_TIMEOUT_ENV: (f"{IMPORT_TIMEOUT_S:g}",
                         "user-set: seconds a plug-in module may take to import (the manager, `rayapp validate`), "
                         "and under validate each call into plug-in code (rows(cfg), an agent factory); "
                         "`rayapp validate --plugin-timeout` sets it for one check"),
    # read by rayapp.actors.http_auth (not imported here: it imports Ray)
    "RAYAPP_HTTP_TOKEN": ("", "user-set: the bearer token every manager HTTP route but /healthz then needs (a "
                              "Kubernetes Secret as an environment variable; never in a file in a repository)"),
    "RAYAPP_HTTP_TOKEN_FILE": ("", "user-set: a file holding that token (a mounted Secret). Without either, the "
                                   "routes are served only while Serve's proxy listens on loopback, and only "
                                   "with Ray's own cluster token as the bearer token (docs/security.md)"),
}
# Recipe keys that stand for the spec's launch flags.
SPEC_FLAGS = {
    "pool.cluster_layout": "--env-cluster-layout",
    "pool.num_cpus": "--env-num-cpus",
    "pool.memory_gb": "--env-memory-gb",
    "scheduler.save_eval_details": "--save-eval-details",
    "evaluators[].batch_size": "--evaluator-batch-size",
    "evaluators[].resource.concurrency": "--evaluator-concurrency / STACX_DAGGER_ENV_CONCURRENCY",
}


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _dagger_actions() -> list[argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    dagger_schedule.add_dagger_args(parser)
    return parser._actions  # argparse keeps no public list; this is the parser's own record


def _flag_rows(actions: list[argparse.Action]) -> list[str]:
    rows = []
    for action in actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        help_text = (action.help or "") % {"default": action.default}
        rows.append(f"| `{', '.join(action.option_strings)}` | `{action.default}` | {_cell(help_text)} |")
    return rows


def flag_rows() -> list[str]:
    return _flag_rows(_dagger_actions())


def demo_flag_rows() -> list[str]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return _flag_rows(sub.choices["demo"]._actions)


def env_rows() -> list[str]:
    rows = []
    for name, meaning in sorted(dagger_schedule.ENV_VARS.items()):
        rows.append(f"| `{name}` | — | {_cell(meaning)} |")
    for name, (default, meaning) in sorted({**reuse.ENV_KNOBS, **RECIPE_ENV_KNOBS, **OTHER_ENV}.items()):
        rows.append(f"| `{name}` | `{default or '(unset)'}` | {_cell(meaning)} |")
    for name, why in sorted(cli.LOCAL_ENV_WHY.items()):
        rows.append(f"| `{name}` | `{cli.LOCAL_ENV[name]}` in `rayapp demo` and the tests | {_cell(why)} |")
    return rows


def _default(f: msgspec.inspect.Field) -> str:
    if f.required:
        return "(required)"
    value = f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
    if isinstance(value, msgspec.Struct) and value == msgspec.convert({}, type(value)):
        return "{}"  # a section left at its defaults
    return repr(value)


def _walk(info: Any, prefix: str) -> list[tuple[str, str, str, str]]:
    """(key path, type, default, meaning) for every field of a recipe Struct, a section before its
    fields. The meaning is the field's ``Annotated[T, msgspec.Meta(description=...)]``."""
    out = []
    for f in info.fields:
        path, t, meaning = f"{prefix}{f.name}", f.type, ""
        if isinstance(t, msgspec.inspect.Metadata):
            meaning, t = (t.extra_json_schema or {}).get("description", ""), t.type
        if isinstance(t, msgspec.inspect.UnionType):  # X | None: describe X
            inner = [a for a in t.types if not isinstance(a, msgspec.inspect.NoneType)]
            t = inner[0] if len(inner) == 1 else t
        if isinstance(t, msgspec.inspect.Metadata):  # Annotated[X, Meta(bounds, description)] | None
            meaning, t = meaning or (t.extra_json_schema or {}).get("description", ""), t.type
        kind = type(t).__name__.removesuffix("Type").lower()
        if isinstance(t, msgspec.inspect.LiteralType):  # a closed set of names: list them
            kind = " or ".join(map(str, t.values))
        out.append((path, kind, _default(f), meaning))
        if isinstance(t, msgspec.inspect.StructType):
            out += _walk(t, path + ".")
        elif isinstance(t, msgspec.inspect.ListType) and isinstance(t.item_type, msgspec.inspect.StructType):
            out += _walk(t.item_type, path + "[].")
        elif isinstance(t, msgspec.inspect.DictType) and isinstance(t.value_type, msgspec.inspect.StructType):
            out += _walk(t.value_type, path + ".<name>.")
    return out


def _dagger_help() -> dict[str, str]:
    """``dagger.<field>`` -> its --dagger-* flag's help, so the meaning is written once, in dagger_schedule.py."""
    flags = {flag: field for field, flag in dagger_schedule.FLAGS.items()}
    return {f"dagger.{flags[a.option_strings[0]]}": re.sub(r"\s*\(default: %\(default\)s\)$", "", a.help or "")
            for a in _dagger_actions() if a.option_strings and a.option_strings[0] in flags}


def recipe_rows() -> list[str]:
    rows = []
    flags = SPEC_FLAGS | {f"dagger.{field}": flag for field, flag in dagger_schedule.FLAGS.items()}
    dagger_help = _dagger_help()
    for path, kind, default, meaning in _walk(msgspec.inspect.type_info(RecipeConfig), ""):
        flag = flags.get(path, "")
        meaning = meaning or dagger_help.get(path, "")
        rows.append(f"| `{path}` | {kind} | `{_cell(default)}` | {_cell(meaning)} | {f'`{flag}`' if flag else ''} |")
    return rows


# One way to do each thing (issue 31): a key with several modes says here who needs each.
MODES: dict[str, str] = {
    "engines.<name>.backend": "hf for tests, CPU-only machines and tiny models (nothing to serve); sglang for "
                              "a GPU run that needs batched generation at speed.",
    "engines.<name>.placement_group_strategy": "STRICT_PACK for an engine whose GPUs must share a node "
                                               "(tensor parallel); the others, Ray's own, for an engine "
                                               "spread over nodes.",
    "evaluators[].sandbox.kind": "local for agents whose commands are trusted on the node; docker for agents "
                                 "that run untrusted code (SWE tasks) and need an image's tools and isolation.",
    "evaluators[].gateway.segments": "last for a trainer that learns from the last call, which holds the whole "
                                     "conversation; each for an agent that rewrites or trims its history, whose "
                                     "earlier tokens the last segment no longer holds.",
    "scheduler.partial.policy": "resume to keep what a cut-short group did; restart for a trainer that needs "
                                "each sample generated start to end under one weight version.",
    "dagger.beta_schedule": "for a user tuning how fast the expert hands over to the student; linear unless an "
                            "experiment calls for another curve.",
}


def mode_rows() -> list[str]:
    return [f"| `{key}` | {who} |" for key, who in MODES.items()]


def removed_rows() -> list[str]:
    return [f"| `{section}.{key}` | {_cell(why)} |" for (section, key), why in REMOVED.items()]


def render() -> str:
    return "\n".join([
        "# Knob reference",
        "",
        "Generated by `python -m rayapp.knobs > docs/knobs.md` from the code's own definitions; a test fails",
        "when this page and the code drift apart. Variables marked *code-set* are written by the scheduler",
        "per iteration: never set those by hand.",
        "",
        "## CLI flags",
        "",
        "| flag | default | meaning |",
        "| --- | --- | --- |",
        *flag_rows(),
        "",
        "`rayapp demo` (the embedded default end to end; `make demo`, `make demo-dagger`):",
        "",
        "| flag | default | meaning |",
        "| --- | --- | --- |",
        *demo_flag_rows(),
        "",
        "## Environment variables",
        "",
        "The user-set `STACX_*` variables are read once, in the manager's process when it builds the recipe",
        "(`rayapp/recipe/environment.py`); a bad value stops the build with an error naming the variable.",
        "",
        "| variable | default | meaning |",
        "| --- | --- | --- |",
        *env_rows(),
        "",
        "## Recipe keys (`args` of the rayapp application in a Serve config)",
        "",
        "The spec's launch flags are recipe keys here; the last column names the flag a key stands for.",
        "A section (type struct, dict or list) comes before its own keys; `{}` is a section left at its defaults.",
        "",
        "| key | type | default | meaning | spec flag |",
        "| --- | --- | --- | --- | --- |",
        *recipe_rows(),
        "",
        "## Modes: who needs each",
        "",
        "| key | who needs which |",
        "| --- | --- |",
        *mode_rows(),
        "",
        "## Removed keys (a recipe that sets one is refused, naming it)",
        "",
        "| key | now |",
        "| --- | --- |",
        *removed_rows(),
        "",
    ])


if __name__ == "__main__":
    print(render(), end="")
