"""A recipe read from its file: a Serve config (the args of its rayapp application) or a bare args mapping,
its relative paths resolved, then everything checked that needs the file's side (a layout file, dataset
files, the wiring's builds). Above ``config`` (the typed recipe) and ``wiring``, so neither imports it."""

from __future__ import annotations

import itertools
import os
from typing import Any

from rayapp.core.convert import show
from rayapp.core.layout import is_inline
from rayapp.recipe.config import RecipeConfig, RecipeError, check_layout, parse_recipe
from rayapp.recipe.limits import check_limits, layout_of
from rayapp.recipe.paths import with_paths_from
from rayapp.recipe.plugin_checks import check_dataset_files
from rayapp.recipe.wiring import check_builds
from rayapp.recipe.yaml_doc import YamlError, read_yaml

APP_IMPORT_PATH = "rayapp.actors.app:build_app"
# The top-level keys of a Serve config besides "applications" (ray.serve.schema.ServeDeploySchema).
SERVE_KEYS = {"proxy_location", "http_options", "grpc_options", "controller_options", "logging_config",
              "tracing_config", "target_capacity"}


def read_recipe_file(path: str | os.PathLike) -> Any:
    """The YAML document in ``path``, read within bounds (``yaml_doc``), or one RecipeError naming it."""
    try:
        return read_yaml(path)
    except OSError as e:
        raise RecipeError(path, None, f"cannot read file: {e.strerror or e}") from None
    except YamlError as e:
        raise RecipeError(path, e.path, e.reason) from None


def recipe_document(path: str | os.PathLike, app: int | None = None) -> tuple[Any, Any, str]:
    """The file ``path`` read, its relative dataset paths and folders resolved against its folder: (the document,
    the recipe's args in it, their JSON path). ``app``: which of a Serve config's applications (by index; its
    import_path must be rayapp's builder); None: the first whose import_path is."""
    doc = read_recipe_file(path)
    base = os.path.dirname(os.path.abspath(path))
    args, root = doc, "$"
    serve_keys = sorted(set(doc) & SERVE_KEYS) if isinstance(doc, dict) else []
    if serve_keys and "applications" not in doc:
        raise RecipeError(path, "$", f"a Serve config ({', '.join(serve_keys)}) needs \"applications\": a list with "
                                     f"an application whose import_path is {APP_IMPORT_PATH} and whose args are "
                                     f"the recipe")
    if isinstance(doc, dict) and "applications" in doc:
        apps = doc["applications"] if isinstance(doc["applications"], list) else []
        i = next((i for i, a in enumerate(apps) if isinstance(a, dict) and a.get("import_path") == APP_IMPORT_PATH
                  and app in (None, i)), None)
        if i is None:
            raise RecipeError(path, "$.applications", f"no application with import_path {APP_IMPORT_PATH}")
        args, root = with_paths_from(apps[i].get("args"), base), f"$.applications[{i}].args"
        doc = {**doc, "applications": [*apps[:i], {**apps[i], "args": args}, *apps[i + 1:]]}
    else:
        doc = args = with_paths_from(args, base)
    return doc, args, root


def load_recipe(path: str | os.PathLike, app: int | None = None) -> tuple[dict[str, Any], RecipeConfig]:
    """The recipe in file ``path``: a Serve config (the args of its rayapp application) or a bare args
    mapping, as (args, RecipeConfig), its layout file (relative to the working directory) and dataset
    files (relative to the recipe file's folder, as its folders are) read too; any failure is one
    RecipeError naming ``path``. ``app``: as ``recipe_document`` takes it."""
    _, args, root = recipe_document(path, app)
    if not isinstance(args, dict):
        raise RecipeError(path, root, f"expected an object of recipe sections, got {show(args)}")
    try:
        recipe = parse_recipe(args, source=path)
        # a layout file and dataset files too, from here
        layout_file = recipe.pool.cluster_layout is not None and not is_inline(recipe.pool.cluster_layout)
        fit = check_limits(recipe, layout_of(recipe.pool)) if layout_file else iter(())
        problem = next(itertools.chain(check_layout(recipe.pool), fit, check_dataset_files(recipe),
                                       check_builds(recipe)), None)
        if problem is not None:
            raise RecipeError(path, *problem)
    except RecipeError as e:  # the path inside the file, not inside the args
        raise RecipeError(path, root + (e.path or "$")[1:], e.reason) from None
    return args, recipe
