"""The demo is visibly working: its recipe's `math-read` eval set, run with the shipped tiny model in
this process (the real hf backend, no Ray), scores above 0, and the driver's failure-class line shows
successes beside wrong answers. With every reward 0 (a broken verifier, a task the model cannot
solve), this fails."""

import importlib.util

import msgspec
import pytest
from agent_helpers import InProcessEngine
from conftest import run

from rayapp.cli import ROOT
from rayapp.cli.launch import TINY_MODEL_NOTE
from rayapp.inference.hf import HFBackend
from rayapp.inference.tiny_model import SHIPPED
from rayapp.recipe import build_step_runner, load_recipe

RECIPE = ROOT / "recipes" / "local" / "rollout.yaml"


def driver():
    spec = importlib.util.spec_from_file_location("demo_driver", ROOT / "recipes" / "driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def evaluated():
    cfg = load_recipe(RECIPE)[1]
    cfg = msgspec.structs.replace(cfg, eval={k: cfg.eval[k] for k in ("math-read", "arith-cut")})

    async def inline(token, fn, *args):
        return fn(*args)

    async def no_sandbox(*args, **kwargs):
        raise AssertionError("math and arithmetic open no sandbox")

    backend = HFBackend(str(SHIPPED), max_concurrency=4, seed=0)
    try:
        runner = build_step_runner(cfg, {"student": InProcessEngine(backend)}, None, executor=inline,
                                   open_sandbox=no_sandbox)
        yield run(runner.evaluate(0))
    finally:
        backend.shutdown()


def test_the_task_the_tiny_model_solves_scores_above_zero(evaluated):
    samples = evaluated.samples["math-read"]
    assert len(samples) == 8  # 4 prompts x 2
    assert all(s.response.startswith("The answer is") for s in samples), [s.response for s in samples]
    # measured: 13 of 16 right at this temperature over two seeds; luck (a guessed number) is ~0
    assert sum(s.reward["score"] for s in samples) >= 4, [(s.label, s.response) for s in samples]
    assert evaluated.metrics["eval/math-read/pass@2"] > 0


def test_the_driver_shows_a_mix_of_failure_classes(evaluated):
    classes = driver().failure_classes([s for ss in evaluated.samples.values() for s in ss])
    cut = [(s.response, s.metadata.get("_termination_reason")) for s in evaluated.samples["arith-cut"]]
    assert classes.get("success", 0) >= 4 and classes.get("max_context", 0) == 2, (classes, cut)  # arith-cut


def test_the_demo_says_which_tasks_the_model_cannot_solve():
    for name in ("math-read", "humaneval", "swe", "arith-a", "rayapp verify local"):
        assert name in TINY_MODEL_NOTE
