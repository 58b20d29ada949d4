"""The engine deployment class (``rayapp.actors.engine.InferenceEngine``, what a Serve replica holds) over
a real SGLang CPU engine, called in-process (``make test-sglang``): the recipe's options reach
SGLangBackend through ``make_backend``, weight paths are confined to ``weight_roots`` before SGLang
sees them, and a replica asked again for the weights it serves loads nothing.

Its own engine: the module's fixture shuts it down before test_engine.py's starts (one at a time)."""

from __future__ import annotations

import os
import shutil

import pytest

if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
    pytest.skip("the real-engine lane: make test-sglang", allow_module_level=True)

from rayapp.actors.engine import InferenceEngine
from rayapp.inference import GenerateRequest
from rayapp.inference.tiny_model import ensure_tiny_model
from rayapp.inference.weight_paths import WeightPathError
from rayapp.inference.weight_sync import Applied
from rayapp.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=6)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def replica(root, loop):
    engine = InferenceEngine(backend="sglang", weight_roots=[str(root)], model_path=str(ensure_tiny_model()),
                             device="cpu", max_total_tokens=2048, log_level="error")
    yield engine, loop.run_until_complete
    engine.backend.shutdown()


def test_a_replica_serves_and_says_what_it_serves(replica):
    engine, run = replica
    info = engine.info()
    assert info["backend"] == "sglang" and info["max_prompt_len"] < info["max_context_len"]
    assert "tokenizer.json" in engine.tokenizer_files()
    run(engine.check_health())  # raises when unhealthy
    out = run(engine.generate(GenerateRequest([1, 4, 302], GREEDY)))
    assert out.output_ids and out.weight_version == 0 and engine.applied_weights() is None


def test_weights_outside_the_roots_are_refused_before_sglang_reads_them(replica, tmp_path):
    engine, run = replica
    outside = tmp_path / "elsewhere"
    shutil.copytree(ensure_tiny_model(), outside)
    with pytest.raises(WeightPathError, match="refused"):
        run(engine.update_weights_from_disk(str(outside), 1))
    assert engine.applied_weights() is None and engine.backend.info()["weight_version"] == 0


def test_weights_inside_the_roots_load_once_per_path_and_version(replica, root):
    engine, run = replica
    inside = root / "step-1"
    shutil.copytree(ensure_tiny_model(), inside)
    first = run(engine.update_weights_from_disk(str(inside), 1))
    assert first["ok"] and first["version"] == 1
    again = run(engine.update_weights_from_disk(str(inside), 1))
    assert again == {"ok": True, "path": str(inside), "version": 1, "loaded": False}
    assert engine.applied_weights() == Applied(str(inside), 1)
    assert run(engine.generate(GenerateRequest([1, 4, 302], GREEDY))).weight_version == 1
