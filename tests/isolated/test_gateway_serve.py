"""Agents written against the OpenAI API, run as episodes through the manager's gateway on `serve run` with the real
hf engine and the real openai SDK, HTTP token on (the manager's admin routes need it; the gateway's routes take
the episode's key instead). The example recipe (examples/openai_agent) runs by `rayapp run`, and under `serve
run` beside two test agents (tests/isolated/gateway_agents.py): one whose episodes are multi-turn (a tool result
in its history, a streamed call, a plain call), one cut by its episode's clock. Every sample's loss mask is 1
exactly on the engine's replies of its calls, with their log-probs; template tokens are mask 0 with log-prob 0.0;
rewards are the verifier's. On the isolated files' shared Ray head (conftest.py)."""

import itertools
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import yaml
from shared_head import serve_app, start_serve

from rayapp.cli import ROOT
from rayapp.cli.local_cluster import app_status

EXAMPLE = ROOT / "examples" / "openai_agent"
HTTP_TOKEN = "rayapp-test-" + os.urandom(16).hex()
DRIVER = r"""
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="rayapp-gateway", logging_level="error", log_to_driver=False)
h = serve.get_app_handle("rayapp")
r = h.generate.remote(0).result(timeout_s=600)
ev = h.evaluate.remote(0).result(timeout_s=600)
def row(s):
    m = s.metadata
    return dict(status=s.status.value, task_id=s.task_id, label=s.label, tokens=s.tokens, response=s.response,
                response_length=s.response_length, loss_mask=s.loss_mask, logprobs=s.rollout_log_probs,
                reward=s.reward, gateway=m.get("gateway"), turns=m.get("_turns"),
                reason=m.get("_termination_reason"), abort=m.get("_abort"))
print("RESULT " + json.dumps({"rollout": [row(s) for g in r.groups for s in g],
                              "eval": {name: [row(s) for s in ss] for name, ss in ev.samples.items()}}))
"""


def test_rayapp_run_runs_the_example_recipe(head, tmp_path):
    """``rayapp run --address`` onto a running cluster (its own head is the demo's and test_quiet_logs')."""
    start_serve(head)  # the example names its own HTTP port: Serve's proxy stays on the shared one
    proc = subprocess.run([sys.executable, "-m", "rayapp.cli", "run", str(EXAMPLE), "--address", head.address,
                           "--temp-dir", str(tmp_path / "run"), "--", "--rollouts", "1", "--eval"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert f"ray cluster at {head.address}" in proc.stdout and "driver done" in proc.stdout, proc.stdout
    assert app_status(head.address, "rayapp")[0] == "MISSING"  # the user's cluster goes on without our app


@pytest.fixture(scope="module")
def app(head, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    token_file = tmp / "http-token"
    token_file.write_text(HTTP_TOKEN + "\n")
    cfg = yaml.safe_load((EXAMPLE / "rollout.yaml").read_text())
    application = cfg["applications"][0]
    application["runtime_env"] = {"env_vars": {"RAYAPP_HTTP_TOKEN_FILE": str(token_file)}}
    args = application["args"]
    [example] = args["evaluators"]
    for evaluator_id, agent, stopping in (
            ("arith-chat", "gateway_agents:chat", {"max_turns": 3, "max_context_len": 1024, "timeout_s": 120}),
            ("arith-slow", "gateway_agents:forever", {"max_turns": 10_000, "max_context_len": 1024, "timeout_s": 2})):
        args["evaluators"].append({**example, "evaluator_id": evaluator_id, "gateway": {"agent": agent},
                                   "default_stopping": stopping})
    args["eval"]["chat"] = {"env": "arithmetic", "task_type": "arith-chat", "seed": 7, "n_prompts": 3}
    args["eval"]["slow"] = {"env": "arithmetic", "task_type": "arith-slow", "seed": 9, "n_prompts": 1}
    with serve_app(head, cfg, tmp):
        proc = subprocess.run([sys.executable, "-c", DRIVER, head.address], capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        yield {"http": f"http://127.0.0.1:{head.http_port}/rayapp",
               "result": json.loads(proc.stdout.split("RESULT ", 1)[1])}


@pytest.fixture(scope="module")
def tok():
    from rayapp.inference.tiny_model import ensure_tiny_model, load_tokenizer

    return load_tokenizer(ensure_tiny_model())


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """The [start, end) runs of 1s in a loss mask."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check_tokens(s: dict, tok) -> list[str]:
    """The sample's token data as the accounting promises it; the engine's replies' texts."""
    n = s["response_length"]
    assert len(s["loss_mask"]) == len(s["logprobs"]) == n > 0
    response = s["tokens"][-n:]
    for i, (m, lp) in enumerate(zip(s["loss_mask"], s["logprobs"], strict=True)):
        assert lp <= 0 if m else lp == 0.0, (i, m, lp)  # the engine's log-probs on mask 1, 0.0 elsewhere
    replies = spans(s["loss_mask"])
    # one reply per call of the segment, each ended by the engine (its end-of-turn token or the budget)
    assert len(replies) == s["gateway"]["calls"] == s["turns"], s
    between = [response[b:a] for (_, b), (a, _) in itertools.pairwise(replies)]
    for gap in between:  # what the template adds between two replies: a user or tool turn, then the prompt
        text = tok.decode(gap)
        assert ("<|user|>" in text or "<|tool|>" in text) and text.endswith("<|assistant|>"), text
    return [tok.decode(response[a:b], skip_special_tokens=True) for a, b in replies]


def test_the_example_agent_s_samples_came_through_the_gateway(app, tok):
    rollout = app["result"]["rollout"]
    assert len(rollout) == 8  # 4 groups of 2
    for s in rollout:
        assert s["status"] in ("completed", "truncated"), s["abort"]
        assert s["gateway"]["segments"] == 1 and s["gateway"]["reasons"] == {}
        replies = check_tokens(s, tok)
        assert s["response"].strip() == replies[-1].strip()  # the agent returned its last reply's text
        found = re.findall(r"-?\d+", s["response"])
        assert s["reward"] == {"score": float(bool(found) and found[-1] == str(s["label"]))}  # the verifier's


def test_multi_turn_episodes_extend_one_segment_through_streamed_and_plain_calls(app, tok):
    chat = app["result"]["eval"]["chat"]
    assert len(chat) == 6
    for s in chat:
        assert s["status"] == "completed", s["abort"]
        assert s["gateway"]["calls"] == 3 and s["gateway"]["segments"] == 1  # each call extended the last
        assert s["gateway"]["reasons"] == {}
        assert s["turns"] == 3 and s["reason"] == "stop"
        check_tokens(s, tok)
        prompt = tok.decode(s["tokens"][:len(s["tokens"]) - s["response_length"]])
        assert '<tool_call>{"name": "calculator"' in prompt and '"result": "' in prompt  # tool call and result
        found = re.findall(r"-?\d+", s["response"])
        assert s["reward"] == {"score": float(bool(found) and found[-1] == str(s["label"]))}  # the verifier's
    # the tiny model reads a calculator's result back ("The answer is N."): the tool message reached it
    assert any(s["reward"]["score"] == 1.0 for s in chat), [s["response"] for s in chat]


def test_an_episode_past_its_time_is_aborted_and_classified(app):
    slow = app["result"]["eval"]["slow"]
    assert len(slow) == 2
    for s in slow:
        assert s["status"] == "aborted" and s["reason"] == "agent_timeout", s
        assert s["abort"]["phase"] == "run"


def http(url: str, method: str = "GET", body: dict | None = None, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_gateway_routes_take_an_episode_key_and_the_admin_routes_still_need_the_token(app):
    base = app["http"]
    assert http(f"{base}/status")[0] == 401  # the admin token guard holds
    assert http(f"{base}/status", token=HTTP_TOKEN)[0] == 200
    chat = {"model": "rayapp", "messages": [{"role": "user", "content": "hi"}]}
    for token in (None, HTTP_TOKEN):  # no episode of that name: OpenAI's 404, whatever the admin token says
        status, body = http(f"{base}/gateway/no-such-episode/v1/chat/completions", "POST", chat, token)
        assert status == 404 and body["error"]["code"] == "episode_not_found", body
    ended = app["result"]["eval"]["chat"][0]["gateway"]["episode"]  # its sample is back: the episode is over
    status, body = http(f"{base}/gateway/{ended}/v1/chat/completions", "POST", chat, "any-key")
    assert status == 410 and body["error"]["code"] == "episode_ended", body
    assert http(f"{base}/gateway/{ended}/v1/models")[0] == 410
