"""End to end, as users run it: `serve run` on a Ray head with logical GPUs, a separate driver
process calling the manager's handles, the HTTP control surface, the dashboard's placement-group
API, and a clean stop of `serve run`. On the isolated files' shared Ray head (conftest.py)."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from shared_head import serve_app

from rayapp.cli import ROOT

DRIVER = r"""
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], namespace="rayapp-e2e", logging_level="error", log_to_driver=False)
h = serve.get_app_handle("rayapp")
r = h.generate.remote(0).result(timeout_s=600)
ev = h.evaluate.remote(0).result(timeout_s=600)
info = serve.get_deployment_handle("engine-student", "rayapp").info.remote().result(timeout_s=60)
updated = h.update_weights_from_disk.remote("student", info["model_path"]).result(timeout_s=600)
out = {"updated": updated,
       "samples": [dict(status=s.status.value, tokens=len(s.tokens), response_length=s.response_length,
                        logprobs=len(s.rollout_log_probs), loss_mask=len(s.loss_mask), loss_sum=sum(s.loss_mask),
                        reward=s.reward, placement=s.metadata.get("_placement"), text=s.response,
                        dataset=s.metadata.get("_dataset_name"), reason=s.metadata.get("_termination_reason"),
                        abort=s.metadata.get("_abort"))
                   for g in r.groups for s in g],
       "eval": ev.metrics}
print("RESULT " + json.dumps(out))
"""


def get_json(url: str, headers: dict[str, str] | None = None) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:  # 127.0.0.1
        return json.loads(r.read())


def ray_token_header() -> dict[str, str]:
    """The dashboard's API and, with no HTTP token configured, the manager's routes check Ray's token
    (the one local_app made for its head)."""
    return {"Authorization": "Bearer " + Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text().strip()}


def http(url: str, method: str = "GET") -> tuple[int, dict]:
    """Status and JSON body of a request with Ray's cluster token, errors included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method, headers=ray_token_header()),
                                    timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics_port(address: str) -> int:
    code = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='error', log_to_driver=False); "
            "print(ray.nodes()[0]['MetricsExportPort'])")
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip().splitlines()[-1])


def scrape(port: int) -> dict[str, float]:
    """rayapp's series on Ray's metrics endpoint (127.0.0.1), summed over their tags, by name{tags}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_rayapp_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def app(head, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    cfg = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())
    details = tmp / "details"
    cfg["applications"][0]["args"]["scheduler"]["save_eval_details"] = str(details)
    cfg["applications"][0]["logging_config"] = {"encoding": "JSON"}  # rayapp's lines follow it too
    with serve_app(head, cfg, tmp) as proc:
        yield {"head": head, "address": head.address, "http": f"http://127.0.0.1:{head.http_port}/rayapp",
               "dash": head.dashboard_port, "proc": proc, "log": tmp / "serve.log",
               "details": details / "eval_details", "timeline": details / "timeline",
               "metrics": metrics_port(head.address)}


def test_driver_gets_samples_with_token_data_and_the_dashboard_lists_the_batch_groups(app):
    groups_seen: set[str] = set()
    stop = threading.Event()
    scraped: list[dict[str, float]] = []

    auth = ray_token_header()

    def watch():  # the dashboard's state API and Ray's metrics endpoint, polled while the driver runs
        while not stop.is_set():
            with contextlib.suppress(OSError):
                scraped.append(scrape(app["metrics"]))
            try:
                data = get_json(f"http://127.0.0.1:{app['dash']}/api/v0/placement_groups?limit=1000", auth)
                for pg in data["data"]["result"]["result"]:
                    if pg["name"].startswith("rayapp/") and pg["state"] == "CREATED":
                        groups_seen.add(pg["name"])
            except OSError:
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proc = subprocess.run([sys.executable, "-c", DRIVER, app["address"]], capture_output=True, text=True,
                          timeout=900)
    stop.set()
    watcher.join(timeout=10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    samples = result["samples"]
    assert len(samples) == 16  # 8 prompts x 2 samples, mixed over the four environments
    assert {s["dataset"] for s in samples} <= {"arithmetic", "math", "humaneval", "swe", "math-read"}
    assert len({s["dataset"] for s in samples}) >= 3
    for s in samples:
        assert s["status"] in {"completed", "truncated"}, (s["dataset"], s["reason"], s["abort"])
        # loss mask and log-probs cover the response exactly; only model tokens carry loss
        assert s["response_length"] == s["logprobs"] == s["loss_mask"] >= s["loss_sum"] > 0, s
        assert s["tokens"] > s["response_length"]
        assert s["placement"]["gpu"] == (0.0 if s["dataset"] == "swe" else 0.25) and s["placement"]["node"]
        assert s["reward"]["score"] in (0.0, 1.0)
    assert {f"eval/{n}/pass@2" for n in ("arith-a", "math", "humaneval", "swe", "math-read")} <= set(result["eval"])
    assert result["eval"]["eval/math-read/pass@2"] > 0  # the task the tiny model solves
    assert len(result["updated"]) == 1 and result["updated"][0]["ok"]  # one replica reloaded from disk
    # --save-eval-details: one line per eval sample, the placement log, the failure-class summaries
    lines = (app["details"] / "0.jsonl").read_text().splitlines()
    assert len(lines) == 26 and all(json.loads(line)["dataset"] for line in lines)  # 13 eval prompts x 2
    assert (app["details"] / "0.placement.jsonl").read_text().strip()
    summary = json.loads((app["details"] / "0.summary.json").read_text())
    assert sum(summary["failure_classes"].values()) == 26, summary
    assert (app["details"] / "train_0.summary.json").exists()
    # each step's placement timeline, a Chrome trace with a process per node and the pool queue
    trace = json.loads((app["timeline"] / "train_0.trace.json").read_text())
    processes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert "pool queue" in processes and len(processes) >= 2
    assert len([e for e in trace["traceEvents"] if e.get("cat") == "run"]) == 16
    assert (app["timeline"] / "eval_0.trace.json").exists()
    assert (app["timeline"] / "train_0.png").read_bytes()[:4] == b"\x89PNG"  # matplotlib: the 'plot' extra
    # Prometheus metrics on Ray's endpoint, seen while the steps ran
    seen = {k: v for m in scraped for k, v in m.items()}
    series = {name.split("{")[0] for name in seen}
    assert {"ray_rayapp_samples_total", "ray_rayapp_episode_phase_seconds_bucket", "ray_rayapp_batches",
            "ray_rayapp_pool_resource", "ray_rayapp_engine_request_seconds_count",
            "ray_rayapp_admission_wait_seconds_count"} <= series, sorted(series)
    done = max(sum(v for k, v in m.items() if k.startswith("ray_rayapp_samples_total{")) for m in scraped)
    assert done >= 16  # the rollout's samples, counted as they finished
    gpus = [v for k, v in seen.items() if k.startswith("ray_rayapp_pool_resource{")
            and 'resource="gpu"' in k and 'state="capacity"' in k]
    assert gpus and sum(gpus) == 4  # the four logical GPUs of the head
    # rayapp's log lines in the manager's replica follow the app's logging_config: JSON lines
    logs = list((app["head"].temp_dir / "session_latest" / "logs" / "serve").glob("replica_rayapp_*Manager*.log"))
    lines = [json.loads(line) for f in logs for line in f.read_text().splitlines() if line.startswith("{")]
    assert any(line.get("message", "").startswith("rollout 0: 16 samples") for line in lines), logs
    # the dashboard shows the pool's reservation, one group per node; which batch holds what is /placement's
    assert any(name.startswith("rayapp/node/") for name in groups_seen), groups_seen
    assert not any(name.startswith(("rayapp/rollout", "rayapp/eval")) for name in groups_seen), groups_seen


def test_http_control_surface(app):
    assert get_json(f"{app['http']}/healthz") == {"ok": True}
    for bad in ("-1", "2147483648", "99999999999999999999"):  # step ids are 0 .. 2**31-1
        status, body = http(f"{app['http']}/rollout/{bad}", "POST")
        assert status == 422 and body["error"] == "ValueError" and "step id" in body["message"], bad
    assert http(f"{app['http']}/rollout/6")[0] == 404  # never asked for

    before = get_json(f"{app['http']}/status", ray_token_header())["steps_run"]["rollout"]
    try:  # no route is open by default: another user of the machine, without Ray's token, starts nothing
        urllib.request.urlopen(urllib.request.Request(f"{app['http']}/rollout/5", method="POST"), timeout=60)
        raise AssertionError("POST /rollout/5 without a token was served")
    except urllib.error.HTTPError as e:
        assert e.code == 401
    answers = [http(f"{app['http']}/rollout/7", "POST") for _ in range(2)]  # 202 at once; the second joins
    assert [a[0] for a in answers] == [202, 202] and answers[0][1]["poll"] == answers[1][1]["poll"]
    assert answers[0][1]["poll"].endswith("/rayapp/rollout/7")
    status, body = http(f"{app['http']}/rollout/8", "POST")  # another rollout while 7 runs: a conflict
    assert status == 409 and body["error"] == "Conflict" and "rollout 7 is in flight" in body["message"]
    deadline = time.monotonic() + 600
    while (poll := http(answers[0][1]["poll"]))[1].get("state") == "running" and time.monotonic() < deadline:
        assert poll[0] == 200 and "progress" in poll[1]
        time.sleep(1)
    status, summary = poll
    assert status == 200 and summary["state"] == "done", summary
    assert summary["rollout_id"] == 7 and summary["samples"] == 16 and "rollout/time/step_s" in summary["metrics"]
    status = get_json(f"{app['http']}/status", ray_token_header())
    assert status["steps_run"]["rollout"] == before + 1  # two POSTs, one step
    assert status["busy"] is False and status["phase"] == "rollout done" and status["tasks_done"] == 8
    placement = get_json(f"{app['http']}/placement", ray_token_header())
    assert placement["gated"] is True and placement["held_tokens"] == 0 and placement["batches"] == {}
    spec = get_json(f"{app['http']}/openapi.json")  # the API documents itself
    assert {"/rollout/{rollout_id}", "/eval/{rollout_id}", "/status", "/placement"} <= set(spec["paths"])
    assert {"202", "409", "503"} <= set(spec["paths"]["/rollout/{rollout_id}"]["post"]["responses"])


TASKS_DRIVER = r"""
import json, sys, ray
from ray import serve
from rayapp.trainers.step_tasks import tasks_from_rows
ray.init(address=sys.argv[1], namespace="rayapp-e2e", logging_level="error", log_to_driver=False)
h = serve.get_app_handle("rayapp")
tasks = tasks_from_rows([{"prompt": "What is 2 + 3?", "label": "5"}], task_type="arithmetic", n_samples=2)
tasks.append({"task_id": "mine", "prompt": "What is 4 * 4?", "config": {"task_type": "arithmetic"}, "label": "16"})
def ran():
    return h.status.remote().result(timeout_s=60)["steps_run"]["rollout"]
before = ran()
first = h.generate.remote(20, tasks).result(timeout_s=600)
again = h.generate.remote(20, tasks).result(timeout_s=600)
errors = []
for args in ((20, [tasks[1]]), (20,), (21, [{"task_id": "x", "prompt": "p"}])):  # each refused, nothing runs
    try:
        h.generate.remote(*args).result(timeout_s=600)
    except Exception as e:
        errors.append(str(e))
def rows(r):
    return [[(s.task_id, s.index, s.label, s.metadata["_group_id"], s.response) for s in g] for g in r.groups]
print("RESULT " + json.dumps({"first": rows(first), "again": rows(again), "errors": errors, "ran": ran() - before}))
"""


def test_the_trainer_chooses_a_steps_tasks_through_the_handle(app):
    proc = subprocess.run([sys.executable, "-c", TASKS_DRIVER, app["address"]], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    first = out["first"]
    assert [[s[:4] for s in g] for g in first] == [[["trainer-0", 0, "5", "20/0"], ["trainer-0", 1, "5", "20/0"]],
                                                   [["mine", 0, "16", "20/1"]]]
    assert out["again"] == first  # the same id with the same tasks: served, not run again
    other, none, bad = out["errors"]
    assert "rollout 20 ran with trainer-chosen tasks" in other and "now asked for with trainer-chosen" in other
    assert "rollout 20 ran with trainer-chosen tasks" in none and "the data source's tasks" in none
    assert "rollout 21: tasks[0]: $.config: missing required field" in bad
    assert out["ran"] == 1  # rollout 20, once


def test_the_app_stops_cleanly(app):
    proc = app["proc"]
    proc.send_signal(signal.SIGINT)  # what Ctrl-C on `serve run` sends
    assert proc.wait(timeout=300) is not None  # Serve's graceful stop of every replica, on a loaded machine
    assert "Shutting down" in app["log"].read_text() or proc.returncode in (0, -signal.SIGINT, 130)
    # the application is gone from the cluster (a head of rayapp's own is stopped by local_app: test_quiet_logs);
    # serve run's Ctrl-C path shuts Serve down, and no Serve running is no application either
    code = ("import ray, sys; from ray import serve; from ray.serve.exceptions import RayServeException; "
            "ray.init(address=sys.argv[1], logging_level='error', log_to_driver=False)\n"
            "try:\n    print(sorted(serve.status().applications))\nexcept RayServeException:\n    print([])")
    for _ in range(30):
        out = subprocess.run([sys.executable, "-c", code, app["address"]], capture_output=True, text=True, timeout=120)
        if out.stdout.strip().endswith("[]"):
            break
        time.sleep(2)
    assert out.stdout.strip().endswith("[]"), (out.stdout, out.stderr[-2000:])
