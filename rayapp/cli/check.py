"""``rayapp validate`` and ``rayapp schema``: a recipe checked offline, before any cluster starts.

A recipe file is a Ray Serve config whose rayapp application's ``args`` are the recipe. ``validate``
checks both halves: the recipe, through the door the app builder uses (``load_recipe``: its
plug-ins' agents built and source rows made as the manager will, ``recipe.wiring.check_builds``), and the
file as Serve reads it (``ray.serve.schema.ServeDeploySchema``: proxy location, HTTP options,
deployments' overrides). Importing that schema starts no Ray. Every problem is printed as
``recipe "<file>": $.json.path: reason``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any

import msgspec

from rayapp.cli.isolate import run_watched
from rayapp.recipe.load import APP_IMPORT_PATH


def json_path(doc: Any, loc: tuple[Any, ...]) -> str:
    """Pydantic's error location as a JSON path into ``doc``. Pydantic puts the names of a union's
    branches into the location too (``num_replicas.constrained-int``): a name that does not index
    into the document is such a tag and is left out, unless it is a missing key at the end."""
    path, node = "$", doc
    for i, key in enumerate(loc):
        if isinstance(key, int) and isinstance(node, list) and 0 <= key < len(node):
            path, node = f"{path}[{key}]", node[key]
        elif isinstance(key, str) and isinstance(node, dict) and (key in node or i == len(loc) - 1):
            path, node = f"{path}.{key}", node.get(key)
    return path


def serve_schema_problems(doc: Any) -> list[tuple[str, str]]:
    """(JSON path, reason) for each way ``doc`` misfits Ray Serve's config schema, one entry per
    path (a union's branches joined with "or"); empty when Serve would accept it."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(doc)
    except ValidationError as e:
        by_path: dict[str, list[str]] = {}
        for err in e.errors():
            reasons = by_path.setdefault(json_path(doc, tuple(err["loc"])), [])
            if err["msg"] not in reasons:
                reasons.append(err["msg"])
        return [(path, " or ".join(reasons)) for path, reasons in by_path.items()]
    return []


# Seconds the watched child is given past a call's own limit before the parent stops it: an import's
# own bound (``rayapp.envs.plugin_import``) fires first and says whether it was slow or stuck.
WATCH_GRACE_S = 2.0


def unknown_serve_keys(doc: Any, model: Any = None, at: str = "$") -> list[tuple[str, str]]:
    """(JSON path, reason) for each key Serve's schema does not know: its models ignore extra keys,
    so a typo (``http_options.prot``) would be dropped without a word. Walks the models that the
    document's objects map to; free-form values (``args``, ``runtime_env``) are left alone."""
    import typing

    from pydantic import BaseModel
    from ray.serve.schema import ServeDeploySchema

    model = model or ServeDeploySchema
    if not isinstance(doc, dict):
        return []
    found = []
    for key, value in doc.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            found.append((f"{at}", f"unknown field {json.dumps(str(key))} (expected one of "
                                   f"{', '.join(model.model_fields)})"))
            continue
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        for kind in kinds:
            inner = typing.get_args(kind)
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += unknown_serve_keys(value, kind, f"{at}.{key}")
            elif inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel) and isinstance(value, list):
                for i, item in enumerate(value):
                    found += unknown_serve_keys(item, inner[0], f"{at}.{key}[{i}]")
    return found


def rayapp_apps(doc: Any) -> list[int | None]:
    """The indices of a Serve config's applications that use rayapp's builder, each a recipe to check
    ([None]: bare args, or a config whose lack of one ``load_recipe`` reports)."""
    apps = doc.get("applications") if isinstance(doc, dict) else None
    found = [i for i, a in enumerate(apps) if isinstance(a, dict) and a.get("import_path") == APP_IMPORT_PATH] \
        if isinstance(apps, list) else []
    return found or [None]


def _recipe_findings(path: str | os.PathLike, app: int | None) -> list[Any]:
    """``[problem, warnings]`` of application ``app`` of ``path`` as lines (the child's side): ``load_recipe``'s
    one problem, else its verifiers' (``recipe.runnable.verifier_problems``: the first); and the recipe's
    warnings (``recipe.runnable.recipe_warnings``)."""
    from rayapp.recipe import RecipeError, load_recipe
    from rayapp.recipe.load import recipe_document
    from rayapp.recipe.runnable import recipe_warnings, routed_rows, verifier_problems

    try:
        _, cfg = load_recipe(path, app)
    except RecipeError as e:
        return [str(e), []]
    root, datasets = recipe_document(path, app)[2], routed_rows(cfg)
    bad = verifier_problems(cfg, datasets)
    problem = str(RecipeError(path, root + bad[0][0][1:], bad[0][1])) if bad else None
    where = f'recipe "{os.fsdecode(path)}"'
    return [problem, [f"{where}: {root}{at[1:]}: warning: {reason}" for at, reason in recipe_warnings(cfg, datasets)]]


def problems(path: str | os.PathLike) -> list[str]:
    """Every problem of the recipe file ``path`` as one line each (``findings``)."""
    return findings(path)[0]


def findings(path: str | os.PathLike) -> tuple[list[str], list[str]]:
    """The recipe file ``path``'s problems and warnings, one line each. Problems: each rayapp
    application's first (the builder stops at it: checked in a watched child, ``cli/isolate.py``, as
    the recipe's plug-ins run, each call into them given ``plugin_timeout_s()``), then Serve's, then
    its ports', then the HTTP token's; empty when all accept the file. Warnings: what the app would
    run, but not as the recipe likely meant."""
    from rayapp.envs.plugin_import import PluginError, plugin_timeout_s
    from rayapp.recipe import RecipeError
    from rayapp.recipe.load import read_recipe_file

    where = f'recipe "{os.fsdecode(path)}"'
    try:
        doc = read_recipe_file(path)
    except RecipeError as e:  # the file is not a document within bounds: nothing more to check
        return [str(e)], []
    try:
        call_timeout_s = plugin_timeout_s()
    except PluginError as e:
        return [str(e)], []
    lines, warnings = [], []
    for app in rayapp_apps(doc):
        found, stuck = run_watched(functools.partial(_recipe_findings, path, app), call_timeout_s, WATCH_GRACE_S)
        line, warned = found if found is not None else (None, [])
        if stuck is not None:
            at, what, outcome = stuck
            root = "$" if app is None else f"$.applications[{app}].args"
            line = f"{where}: {root}{at[1:]}: {what} {outcome}"
        if line is not None:
            lines.append(line)
        warnings += warned
    if isinstance(doc, dict) and "applications" in doc:  # a Serve config, not bare args
        lines += [f"{where}: {at}: {reason}" for at, reason in serve_schema_problems(doc) + unknown_serve_keys(doc)
                  + port_problems(doc) + token_problems(doc)]
    return lines, warnings


def port_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """Serve's schema takes any int as a port: -1 or 70000 would fail only when the proxy binds."""
    found = []
    for section in ("http_options", "grpc_options"):
        options = doc.get(section)
        port = options.get("port") if isinstance(options, dict) else None
        if isinstance(port, int) and not isinstance(port, bool) and not 1 <= port <= 65535:
            found.append((f"$.{section}.port", f"expected a port in 1 .. 65535, got {port}"))
    return found


def token_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """A rayapp application's ``runtime_env.env_vars`` HTTP token held to the rule the manager applies at
    its start (``rayapp.actors.http_auth.load_token``); a token file is read where the manager runs, not here."""
    from rayapp.actors.http_auth import TOKEN_ENV, TOKEN_FILE_ENV, load_token

    found = []
    for app in rayapp_apps(doc):
        env = doc["applications"][app].get("runtime_env") if app is not None else None
        env_vars = env.get("env_vars") if isinstance(env, dict) else None
        token = env_vars.get(TOKEN_ENV) if isinstance(env_vars, dict) else None
        if not token or not isinstance(token, str):  # unset ("" is, to the manager), or Serve's schema says why
            continue
        given = {TOKEN_ENV: token, **({TOKEN_FILE_ENV: "set"} if env_vars.get(TOKEN_FILE_ENV) else {})}
        try:
            load_token(given)  # both set: refused before any file is read
        except ValueError as e:
            found.append((f"$.applications[{app}].runtime_env.env_vars.{TOKEN_ENV}", str(e)))
    return found


def validate(recipe: str | os.PathLike) -> int:
    """Print ``<file>: OK`` (exit status 0) or each problem on stderr (exit status 2); warnings go to
    stderr either way and change no exit status."""
    found, warnings = findings(recipe)
    if warnings:
        print("\n".join(warnings), file=sys.stderr)
    if found:
        print("\n".join(found), file=sys.stderr)
        return 2
    print(f"{os.fsdecode(recipe)}: OK")
    return 0


def recipe_schema() -> dict[str, Any]:
    """The JSON Schema of a recipe (the application's ``args``), from the msgspec types that parse it."""
    from rayapp.recipe import RecipeConfig

    return msgspec.json.schema(RecipeConfig)


def serve_config_schema() -> dict[str, Any]:
    """The JSON Schema of a whole recipe file: Ray Serve's config schema, with the ``args`` of the
    application whose ``import_path`` is rayapp's builder held to the recipe's schema."""
    from ray.serve.schema import ServeDeploySchema

    from rayapp.recipe import RecipeConfig

    serve = ServeDeploySchema.model_json_schema(ref_template="#/$defs/{model}")
    (recipe_ref,), recipe_defs = msgspec.json.schema_components([RecipeConfig], ref_template="#/$defs/{name}")
    defs = serve.setdefault("$defs", {})
    clash = sorted(set(defs) & set(recipe_defs))
    if clash:  # a schema that silently merged two different types under one name would mislead an editor
        raise RuntimeError(f"Serve's and the recipe's schemas both define {clash}")
    defs.update(recipe_defs)
    app = defs["ServeApplicationSchema"]
    app.setdefault("allOf", []).append({
        "if": {"properties": {"import_path": {"const": APP_IMPORT_PATH}}, "required": ["import_path"]},
        "then": {"properties": {"args": recipe_ref}},
    })
    return serve


def schema(serve_config: bool) -> int:
    print(json.dumps(serve_config_schema() if serve_config else recipe_schema(), indent=2))
    return 0
