"""A user's own environment through the Serve app, as a user runs it: examples/wordplay (its env,
agent and verifier named by import path, its rows read from a JSONL file) on `serve run` with the
real hf engine, a driver process calling the manager's handles. On the isolated files' shared Ray head (conftest.py)."""

import json
import subprocess
import sys

import pytest
import yaml
from shared_head import serve_app

from rayapp.cli import ROOT

EXAMPLE = ROOT / "examples" / "wordplay"
DRIVER = r"""
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="rayapp-wordplay", logging_level="error", log_to_driver=False)
h = serve.get_app_handle("rayapp")
r = h.generate.remote(0).result(timeout_s=600)
ev = h.evaluate.remote(0).result(timeout_s=600)
out = {"samples": [dict(status=s.status.value, task_id=s.task_id, prompt=s.prompt, label=s.label, reward=s.reward,
                        response_length=s.response_length, logprobs=len(s.rollout_log_probs),
                        loss_mask=len(s.loss_mask), level=s.metadata.get("level"),
                        dataset=s.metadata.get("_dataset_name"), placement=s.metadata.get("_placement"),
                        abort=s.metadata.get("_abort"))
                   for g in r.groups for s in g],
       "eval": ev.metrics, "eval_ids": sorted({s.task_id for s in ev.samples["words"]})}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def app(head, tmp_path_factory):
    # the user's package is on the path of Ray's head, its workers and serve run (the head's fixture), as
    # the recipe's comment says
    tmp = tmp_path_factory.mktemp("wordplay")
    cfg = yaml.safe_load((EXAMPLE / "rollout.yaml").read_text())
    args = cfg["applications"][0]["args"]
    for section in ("data", "eval"):  # plain serve run hands the args over as they are: make the path absolute
        args[section]["words"]["path"] = str(EXAMPLE / args[section]["words"]["path"])
    with serve_app(head, cfg, tmp):
        yield {"address": head.address}


def test_the_user_s_env_runs_through_the_serve_app(app):
    proc = subprocess.run([sys.executable, "-c", DRIVER, app["address"]], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    samples = result["samples"]
    assert len(samples) == 8  # 4 prompts x 2 samples, all from the file
    rows = {json.loads(line)["id"]: json.loads(line) for line in (EXAMPLE / "data" / "words.jsonl").open()}
    for s in samples:
        assert s["status"] in {"completed", "truncated"}, (s["task_id"], s["abort"])
        row = rows[s["task_id"]]  # the file's id, question, answer and level columns, through the mapping
        assert (s["prompt"], s["label"], s["level"]) == (row["question"], row["answer"], row["level"])
        assert s["dataset"] == "words" and s["placement"]["gpu"] == 0.25
        assert s["response_length"] == s["logprobs"] == s["loss_mask"] > 0
        # the user's verifier scored it: its two keys, and its rule
        assert set(s["reward"]) == {"score", "mentions"}, s["reward"]
        assert s["reward"]["score"] <= s["reward"]["mentions"] and s["reward"]["score"] in (0.0, 1.0)
    assert result["eval_ids"] == ["w00", "w01", "w02", "w03"]
    assert "eval/words/pass@2" in result["eval"] and 0.0 <= result["eval"]["eval/words/pass@2"] <= 1.0
