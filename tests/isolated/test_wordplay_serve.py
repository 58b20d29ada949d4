"""A user's own environment through the Serve app, as a user runs it: examples/wordplay (its env,
agent and verifier named by import path, its rows read from a JSONL file) on `serve run` with the
real hf engine, a driver process calling the manager's handles, and a clean stop. Runs in its own
pytest process (it starts its own Ray cluster)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayapp.cli import LOCAL_ENV, ROOT, free_port, local_app, ray_processes, stop_cluster

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
def app(tmp_path_factory):
    saved = dict(os.environ)
    os.environ.update(LOCAL_ENV)
    # the user's package on the path of Ray's head, its workers and serve run, as the recipe's comment says
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p)
    tmp = tmp_path_factory.mktemp("wordplay")
    cfg = yaml.safe_load((EXAMPLE / "rollout.yaml").read_text())
    http_port = free_port()
    cfg["http_options"]["port"] = http_port
    args = cfg["applications"][0]["args"]
    for section in ("data", "eval"):  # plain serve run hands the args over as they are: make the path absolute
        args[section]["words"]["path"] = str(EXAMPLE / args[section]["words"]["path"])
    recipe = tmp / "rollout.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    temp_dir = Path(f"/tmp/rayapp-wordplay-{os.getpid()}")
    log = tmp / "serve.log"
    try:
        with local_app(recipe, temp_dir, log, timeout_s=600) as (address, proc):
            yield {"address": address, "proc": proc, "temp_dir": temp_dir, "log": log}
    finally:
        os.environ.clear()
        os.environ.update(saved)


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


def test_the_app_stops_cleanly(app):
    proc = app["proc"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) is not None
    assert stop_cluster(app["temp_dir"]) == []
    assert ray_processes(app["temp_dir"]) == []
