"""The tiny model ships built (``tiny_model.SHIPPED``): what every test, the demo and a fresh install
use without the minutes of its build. These check that the shipped build is the one its recipe makes:
its manifest's recipe version, the digest of the data it learnt from made afresh from today's code (a
changed prompt in the corpus shows here), its weights' digest; and that the build itself still runs
(a few pretraining steps) and writes the same tokenizer files. ``make check-tiny-model`` rebuilds it
whole and compares (minutes: not part of ``make test``)."""

import ast
import json
from pathlib import Path

import pytest

from rayapp.envs.tiny_model_recipe import TRAINING, training_digest
from rayapp.inference.tiny_model import (
    MANIFEST,
    SHIPPED,
    WEIGHTS,
    build_tiny_model,
    ensure_built,
    ensure_tiny_model,
    file_digest,
    is_complete,
    load_tokenizer,
)

REBUILD = "the shipped tiny model is not what its recipe builds now: run `make tiny-model` and commit the result"


def test_the_shipped_build_is_what_its_recipe_makes(tmp_path):
    assert is_complete(SHIPPED), REBUILD
    assert ensure_tiny_model(tmp_path) == SHIPPED and not list(tmp_path.iterdir())  # nothing built
    manifest = json.loads((SHIPPED / MANIFEST).read_text())
    assert manifest["training_sha256"] == training_digest(), REBUILD
    assert manifest["weights_sha256"] == file_digest(SHIPPED / WEIGHTS), "the shipped weights were changed by hand"


def test_the_build_runs_and_writes_the_shipped_tokenizer(tmp_path):
    folder = ensure_built(tmp_path / "tiny", lambda f: build_tiny_model(f, TRAINING, pretrain_steps=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        assert (folder / name).read_bytes() == (SHIPPED / name).read_bytes(), name
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["pretrain_steps"] == 2 and manifest["weights_sha256"] == file_digest(folder / WEIGHTS)
    assert load_tokenizer(folder).get_vocab() == load_tokenizer(SHIPPED).get_vocab()


def test_without_the_shipped_build_and_without_training_data_nothing_is_built(tmp_path, monkeypatch):
    from rayapp.inference import tiny_model

    monkeypatch.setattr(tiny_model, "SHIPPED", tmp_path / "not-shipped")
    with pytest.raises(FileNotFoundError, match=r"make tiny-model.*tiny_model_recipe\.TRAINING"):
        tiny_model.ensure_tiny_model(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_the_inference_package_imports_no_environment():
    """The tiny model's training data comes in from its caller (``tiny_model_recipe``): no module of
    ``rayapp.inference`` imports ``rayapp.envs`` or a package above it (the step pipeline, the
    trainers, the CLI)."""
    for path in Path(tiny_model_file()).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        above = ("rayapp.envs", "rayapp.steps", "rayapp.trainers", "rayapp.cli")
        assert not [n for n in names if n.startswith(above)], path.name


def tiny_model_file() -> str:
    from rayapp.inference import tiny_model

    return tiny_model.__file__
