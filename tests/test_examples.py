"""examples/wordplay, a user's own environment package, run through its recipe in this process: the
recipe names its env, agent and verifier by import path and reads its rows from a JSONL file; a
stand-in engine answers through the real tokenizer. (tests/isolated/test_wordplay_serve.py runs the
same recipe through the Serve app with the real hf engine.)"""

import re
from pathlib import Path

import pytest
from conftest import run

from rayapp.inference.client import FinishReason, GenerateOutput
from rayapp.recipe import build_step_runner, load_recipe

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "wordplay"


class WordEngine:
    """Reverses the asked word, except words starting with a vowel, which it gets wrong; records
    what it was asked."""

    def __init__(self, tok, model_dir):
        self.tok, self.model_dir, self.asked = tok, str(model_dir), []

    async def info(self):
        return {"tokenizer_path": self.model_dir}

    async def generate(self, req, timeout_s=None):
        word = re.findall(r"Reverse the word '(\w+)'", self.tok.decode(req.input_ids))[-1]
        text = word if word[0] in "aeiou" else word[::-1]
        self.asked.append((word, req.sampling.temperature))
        ids = [*self.tok.encode(text, add_special_tokens=False), self.tok.eos_token_id]
        return GenerateOutput("r", ids, [-0.25] * len(ids), FinishReason.STOP, text, engine="words")


@pytest.fixture
def wordplay(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))  # as PYTHONPATH=examples/wordplay would
    monkeypatch.chdir(ROOT / "recipes")  # the recipe's data path resolves against its folder, not here
    return load_recipe(EXAMPLE / "rollout.yaml")[1]


def test_the_example_recipe_runs_the_user_s_env_through_the_step_pipeline(wordplay, tok, model_dir):
    from wordplay import ENV, WordAgent, verify

    async def no_sandbox(*args, **kwargs):
        raise AssertionError("wordplay opens no sandbox")

    async def inline(token, fn, *args):
        return fn(*args)

    engine = WordEngine(tok, model_dir)
    runner = build_step_runner(wordplay, {"student": engine}, None, executor=inline, open_sandbox=no_sandbox)
    handler = runner.scheduler.specs["reverse"].handler
    assert isinstance(handler, WordAgent) and handler.verify is verify and ENV.name == "reverse"

    rollout = run(runner.rollout(0))
    samples = [s for g in rollout.groups for s in g]
    assert len(rollout.groups) == 4 and len(samples) == 8  # rollout_batch_size 4, n_samples_per_prompt 2
    for s in samples:
        word = s.prompt.split("'")[1]
        assert s.task_id.startswith("w") and s.metadata["_dataset_name"] == "words"
        assert s.metadata["level"] in (1, 2, 3)  # a mapped metadata column
        assert s.label == word[::-1]
        assert s.reward == {"score": float(word[0] not in "aeiou"), "mentions": float(word[0] not in "aeiou")}
        assert s.response_length == len(s.rollout_log_probs) == len(s.loss_mask) > 0
    assert {t for _, t in engine.asked} == {0.8}  # the dataset's cascade override over the evaluator's 1.0

    engine.asked.clear()
    ev = run(runner.evaluate(0))
    rows = [(s.prompt.split("'")[1], s.reward["score"]) for s in ev.samples["words"]]
    assert sorted({w for w, _ in rows}) == ["apple", "cloud", "river", "stone"]  # the file's first 4 rows
    assert {w: score for w, score in rows} == {"apple": 0.0, "cloud": 1.0, "river": 1.0, "stone": 1.0}
    assert ev.metrics["eval/words/pass@2"] == pytest.approx(0.75)
    assert {t for _, t in engine.asked} == {1.0}  # no override on the eval set: the evaluator's own
