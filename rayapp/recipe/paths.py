"""Where a recipe's relative paths point: its dataset files and scheduler folders resolve against
the recipe file's folder (``load_recipe``, ``recipe_document``), not the working directory of
whichever process reads them."""

from __future__ import annotations

import os
from typing import Any

SCHEDULER_FOLDERS = ("save_eval_details", "trajectory_dir", "checkpoint_dir")


def with_paths_from(args: Any, base: str | os.PathLike) -> Any:
    """``args`` with each relative ``data.<name>.path``, ``eval.<name>.path`` and scheduler folder
    (``SCHEDULER_FOLDERS``) made absolute against ``base`` (the recipe file's folder); anything else
    as it is (a layout file stays relative to where the pool runs: docs/cluster.md)."""
    if not isinstance(args, dict):
        return args

    def absolute(value: Any) -> Any:  # a blank one stays blank, for its check to refuse
        return os.path.join(base, value) if isinstance(value, str) and value.strip() and not os.path.isabs(value) \
            else value

    out = dict(args)
    for where in ("data", "eval"):
        if isinstance(args.get(where), dict):
            out[where] = {name: {**d, "path": absolute(d["path"])} if isinstance(d, dict) and "path" in d else d
                          for name, d in args[where].items()}
    if isinstance(args.get("scheduler"), dict):
        out["scheduler"] = {k: absolute(v) if k in SCHEDULER_FOLDERS else v for k, v in args["scheduler"].items()}
    return out
