"""A weight update reads only inside the engine's weight_roots and opens only regular files
(rayapp.inference.weight_paths, checked in the engine deployment for every backend): each crafted
path is refused by name, within a second, and the replica keeps serving its weights."""

import asyncio
import json
import os
import shutil
import subprocess
import time

import pytest

from rayapp.actors.engine import InferenceEngine
from rayapp.inference.client import GenerateRequest
from rayapp.inference.weight_paths import checkpoint_files, default_weight_roots
from rayapp.inference.weight_sync import Applied
from rayapp.types import SamplingParams


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture(scope="module")
def engine(model_dir):
    return InferenceEngine("hf", model_path=str(model_dir), max_concurrency=2, seed=0)


@pytest.fixture
def roots(engine, tmp_path, model_dir):
    """``root/ckpt``: a valid checkpoint inside the engine's one root; ``outside/ckpt``: one outside."""
    for where in ("root", "outside"):
        (tmp_path / where / "ckpt").mkdir(parents=True)
        shutil.copy(model_dir / "model.safetensors", tmp_path / where / "ckpt" / "model.safetensors")
    engine.weight_roots = [str(tmp_path / "root")]
    return tmp_path


def version(engine) -> int:
    return run(engine.health())["weight_version"]


def greedy(engine) -> list[int]:
    req = GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(temperature=0.0, max_new_tokens=4))
    return run(engine.generate(req)).output_ids


def refused(engine, path: str, *needles: str) -> None:
    before, out = version(engine), greedy(engine)
    started = time.monotonic()
    with pytest.raises(ValueError, match="refused") as e:
        run(engine.update_weights_from_disk(path, before + 1))
    assert time.monotonic() - started < 1.0
    assert f"weights at {path!r} refused" in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)
    assert version(engine) == before and greedy(engine) == out  # still serving what it had


def test_a_checkpoint_inside_the_roots_loads_and_is_not_loaded_twice(engine, roots):
    path = str(roots / "root" / "ckpt")
    v = version(engine) + 1
    assert run(engine.update_weights_from_disk(path, v))["version"] == v == version(engine)
    again = run(engine.update_weights_from_disk(path, v))
    assert again["loaded"] is False and engine.applied_weights() == Applied(path, v)


def test_a_path_outside_the_roots_is_refused(engine, roots):
    refused(engine, str(roots / "outside" / "ckpt"), "outside the engine's weight_roots", str(roots / "root"))


def test_dotdot_traversal_is_refused(engine, roots):
    refused(engine, str(roots / "root" / ".." / "outside" / "ckpt"), "resolving to", str(roots / "outside"))


def test_an_index_whose_weight_map_escapes_is_refused(engine, roots):
    escape = os.path.relpath(roots / "outside" / "ckpt" / "model.safetensors", roots / "root" / "ckpt")
    (roots / "root" / "ckpt" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": escape}}))
    refused(engine, str(roots / "root" / "ckpt"), "outside its folder", escape)


def test_a_symlink_escaping_the_roots_is_refused(engine, roots):
    link = roots / "root" / "ckpt" / "model.safetensors"
    link.unlink()
    link.symlink_to(roots / "outside" / "ckpt" / "model.safetensors")
    refused(engine, str(roots / "root" / "ckpt"), "outside the engine's weight_roots", str(link))


def test_a_fifo_in_the_folder_is_refused_at_once(engine, roots):
    fifo = roots / "root" / "ckpt" / "extra.safetensors"
    os.mkfifo(fifo)
    # A reader blocked in open (the defect: safetensors holds the GIL there, freezing the process) is
    # let go by a writer process after 3 s, so a failing run ends.
    writer = subprocess.Popen(["sh", "-c", 'sleep 3 && : > "$0"', str(fifo)])
    try:
        refused(engine, str(roots / "root" / "ckpt"), "a FIFO", str(fifo))
    finally:
        writer.kill()
        writer.wait()


def test_a_folder_where_a_file_belongs_is_refused(engine, roots):
    (roots / "root" / "ckpt" / "shard.safetensors").mkdir()
    refused(engine, str(roots / "root" / "ckpt"), "is a folder, not a regular file", "shard.safetensors")


def test_relative_paths_no_roots_and_pickles_are_refused(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"")
    for path, roots, needle in (("ckpt", [str(tmp_path)], "absolute"),
                                (str(tmp_path), [], "no weight_roots"),
                                (str(tmp_path / "w.bin"), [str(tmp_path)], "not a .safetensors file"),
                                (str(tmp_path), [str(tmp_path)], "no .safetensors files")):
        with pytest.raises(ValueError, match=needle):
            checkpoint_files(path, roots)


def test_default_roots_are_the_model_folders_parent_and_the_checkpoint_dir(model_dir, tmp_path):
    assert default_weight_roots(str(model_dir), str(tmp_path)) == [str(model_dir.parent), str(tmp_path)]
    assert default_weight_roots("Qwen/Qwen2.5-1.5B-Instruct", None) == []  # a hub id: no folder here
