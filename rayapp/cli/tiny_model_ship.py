"""The tiny model's shipped build (``rayapp.inference.tiny_model.SHIPPED``), kept equal to what its
recipe (``rayapp.envs.tiny_model_recipe``) builds: ``write`` rebuilds it in place (``make tiny-model``,
after a change to the recipe), ``check`` rebuilds it aside and says how the two differ (``make check-tiny-model``)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from rayapp.envs.tiny_model_recipe import TRAINING
from rayapp.inference.tiny_model import (
    MANIFEST,
    MODEL_NAME,
    SHIPPED,
    WEIGHTS,
    build_tiny_model,
    ensure_built,
    is_complete,
)


def compare_builds(shipped: Path, fresh: Path) -> list[str]:
    """How a fresh build differs from the shipped one: each file that differs, and the weights'
    largest difference (the build is seeded and single-threaded, so on one machine it is none;
    another CPU's float kernels may move the weights slightly)."""
    from safetensors.numpy import load_file

    out = []
    for name in sorted({p.name for p in shipped.iterdir()} | {p.name for p in fresh.iterdir()}):
        if name in (MANIFEST, WEIGHTS):
            continue
        a, b = shipped / name, fresh / name
        if not (a.is_file() and b.is_file() and a.read_bytes() == b.read_bytes()):
            out.append(f"{name}: differs")
    old, new = (json.loads((f / MANIFEST).read_text()) for f in (shipped, fresh))
    for key in ("recipe_version", "training_sha256", "params", "config"):
        if old.get(key) != new.get(key):
            out.append(f"{MANIFEST}: {key} {old.get(key)!r} != {new.get(key)!r}")
    a, b = load_file(shipped / WEIGHTS), load_file(fresh / WEIGHTS)
    if a.keys() != b.keys():
        return [*out, f"{WEIGHTS}: other tensors"]
    diff = max(float(abs(a[k] - b[k]).max()) for k in a)
    if diff:
        out.append(f"{WEIGHTS}: largest difference {diff:.3g}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``write``: build the recipe into ``SHIPPED`` (``make tiny-model``); ``check``: build it aside
    and compare with ``SHIPPED`` (``make check-tiny-model``)."""
    parser = argparse.ArgumentParser(prog="python -m rayapp.cli.tiny_model_ship", description=main.__doc__)
    parser.add_argument("action", choices=["write", "check"])
    action = parser.parse_args(argv).action
    with tempfile.TemporaryDirectory() as tmp:
        fresh = ensure_built(Path(tmp) / MODEL_NAME, lambda folder: build_tiny_model(folder, TRAINING))
        print(f"built in {json.loads((fresh / MANIFEST).read_text())['build_seconds']} s", flush=True)
        if action == "write":
            shutil.rmtree(SHIPPED, ignore_errors=True)
            shutil.copytree(fresh, SHIPPED)
            print(f"wrote {SHIPPED}")
            return 0
        differences = compare_builds(SHIPPED, fresh) if is_complete(SHIPPED) else [f"{SHIPPED}: no shipped build"]
    print("\n".join(differences) or f"a fresh build matches {SHIPPED}")
    return 1 if differences else 0


if __name__ == "__main__":
    raise SystemExit(main())
