"""``serve run`` of a recipe whose engine is SGLang (``make test-sglang``): the whole stack as users
deploy it, on a Ray head of its own (127.0.0.1, Ray's token auth on), the recipe
``tests/sglang_engine/recipe/rollout.yaml``: two replicas of a real SGLang CPU engine over the tiny
model, the placement pool on logical GPUs, the manager, the arithmetic env. A driver (this process)
calls the manager and the engine through Serve handles, every call bounded:

- a rollout step and an eval step return samples with real tokens and log-probs from SGLang;
- an abort reaches the replica that holds the request: by id (broadcast, as the manager's client
  does) and by cancelling the caller (Serve routes the cancellation to that replica, whose backend
  aborts it in SGLang: SGLang's answer to it says abort);
- a weight update between two steps reaches both replicas, every turn of the next step names the new
  version, and its log-probs are the new weights' (transformers over the same checkpoint);
- a partial rollout (a second manager, ``recipe/partial.yaml``, over the same engines) cuts a turn in
  one step and resumes it in the next, across a weight update;
- an engine replica killed mid-step: the step still returns every sample exactly once.

Every Ray process runs the lane's interpreter (``ray``/``serve`` through it: ``.venv-sglang`` has no
scripts of its own) and inherits ``SGLANG_USE_CPU_ENGINE=1`` and the stand-ins' ``PYTHONPATH``.
One cluster for the module (an app start with two engines takes about a minute here); the tests run
in file order."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
    pytest.skip("the real-engine lane: make test-sglang", allow_module_level=True)

import torch
import yaml
from safetensors.torch import load_file, save_file

from rayapp.cli import LOCAL_ENV, free_port, local_app
from rayapp.inference import GenerateRequest
from rayapp.inference.client import FinishReason
from rayapp.inference.tiny_model import ensure_tiny_model
from rayapp.types import SamplingParams, Status

RECIPE = Path(__file__).parent / "recipe" / "rollout.yaml"
PARTIAL = RECIPE.with_name("partial.yaml")
ENGINE = "engine-student"
STEP_S = 600  # one step's bound: two CPU engines on a shared 2-core machine


def scripts(folder: Path) -> None:
    """``ray`` and ``serve`` that run this interpreter (local_app finds them on PATH)."""
    for name, module, func in (("ray", "ray.scripts.scripts", "main"), ("serve", "ray.serve.scripts", "cli")):
        path = folder / name
        path.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
        path.chmod(0o755)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    import ray
    from ray import serve

    tmp = tmp_path_factory.mktemp("serve")
    bin_dir, roots = tmp / "bin", tmp / "weights"
    bin_dir.mkdir()
    roots.mkdir()
    scripts(bin_dir)
    saved = {k: os.environ.get(k) for k in (*LOCAL_ENV, "PATH")}
    os.environ.update(LOCAL_ENV)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    cfg = yaml.safe_load(RECIPE.read_text())
    cfg["http_options"]["port"] = free_port()
    student = cfg["applications"][0]["args"]["engines"]["student"]
    student["options"]["model_path"] = str(ensure_tiny_model())
    student["weight_roots"] = [str(roots)]
    recipe = tmp / "rollout.yaml"
    recipe.write_text(yaml.safe_dump(cfg))
    started = time.monotonic()
    try:
        with local_app(recipe, Path(f"/tmp/rayapp-sglang-serve-{os.getpid()}"), tmp / "serve.log",
                       timeout_s=900) as (address, _):
            print(f"\nserve run of {RECIPE.name}: RUNNING after {time.monotonic() - started:.0f}s")
            ray.init(address=address, namespace="rayapp-sglang-lane", logging_level="error", log_to_driver=False)
            try:
                yield {"manager": serve.get_app_handle("rayapp"), "roots": roots, "ray": ray, "serve": serve,
                       "engine": serve.get_deployment_handle(ENGINE, "rayapp"), "args": cfg["applications"][0]["args"]}
            finally:
                ray.shutdown()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def samples_of(result) -> list:
    return [s for g in result.groups for s in g]


def versions(samples) -> set[int]:
    return {t["weight_version"] for s in samples for t in s.metadata.get("_turn_placement", [])}


def in_flight(engine, key: str = "in_flight") -> int:
    """Requests in flight on every replica: the callers its backend answers (``in_flight``), or the
    requests SGLang itself holds (``engine_in_flight``)."""
    return sum(h[key] for h in engine.broadcast("health").results(timeout_s=30))


def given_up(engine) -> dict[str, int]:
    """The requests whose caller gave up, on every replica, by how SGLang ended them."""
    total: dict[str, int] = {}
    for h in engine.broadcast("health").results(timeout_s=30):
        for how, n in h["given_up"].items():
            total[how] = total.get(how, 0) + n
    return total


def wait_in_flight(engine, at_least: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while in_flight(engine) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} requests in flight after {timeout_s}s"
        time.sleep(0.1)


def long_request(rid: str) -> GenerateRequest:
    return GenerateRequest([1, 4, 302, 271], SamplingParams(temperature=0, max_new_tokens=900), request_id=rid,
                           ignore_eos=True)


def test_a_rollout_and_an_eval_return_samples_of_real_sglang_tokens(app):
    started = time.monotonic()
    result = app["manager"].generate.remote(0).result(timeout_s=STEP_S)
    samples = samples_of(result)
    assert [len(g) for g in result.groups] == [2, 2, 2]
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples), [s.metadata for s in samples]
    for s in samples:
        assert 0 < s.response_length <= 16 and len(s.tokens) > s.response_length
        assert len(s.rollout_log_probs) == len(s.loss_mask) == s.response_length
        assert all(lp <= 0 for lp in s.rollout_log_probs) and any(lp < 0 for lp in s.rollout_log_probs)
    turns = [t for s in samples for t in s.metadata["_turn_placement"]]
    # the backend, then the Serve replica that ran the turn
    assert {t["engine"].split("@")[0] for t in turns} == {"sglang"} and versions(samples) == {0}

    ev = app["manager"].evaluate.remote(0).result(timeout_s=STEP_S)
    assert len(ev.samples["arithmetic"]) == 4
    assert all(s.response_length > 0 and s.rollout_log_probs for s in ev.samples["arithmetic"])
    assert any(k.startswith("eval/arithmetic") for k in ev.metrics), ev.metrics
    print(f"rollout 0 ({len(samples)} samples) and eval 0 (4): {time.monotonic() - started:.1f}s")


def test_an_abort_reaches_the_replica_that_holds_the_request(app):
    engine = app["engine"]
    running = engine.generate.remote(long_request("lane-abort"))
    wait_in_flight(engine, 1)
    assert sum(engine.broadcast("abort", "lane-abort").results(timeout_s=30)) == 1  # one replica had it
    out = running.result(timeout_s=60)
    assert out.finish_reason == FinishReason.ABORT and 0 < len(out.output_ids) < 900
    assert in_flight(engine, "engine_in_flight") == 0 and given_up(engine) == {}

    # The caller gives up: Serve cancels the replica's call, whose backend aborts the request in SGLang
    # and counts how SGLang then ended it. "abort" is SGLang's own answer; a cancel that stayed with
    # the caller counts nothing, and one the backend did not pass on counts "length" (all 900 tokens).
    cancelled = engine.generate.remote(long_request("lane-cancel"))
    wait_in_flight(engine, 1)
    cancelled.cancel()
    deadline = time.monotonic() + 60
    while not given_up(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert given_up(engine) == {"abort": 1}
    assert in_flight(engine) == in_flight(engine, "engine_in_flight") == 0


def perturbed_checkpoint(folder: Path) -> Path:
    """The tiny model with noise on every matrix: other weights, the same shapes and files."""
    import shutil

    shutil.copytree(ensure_tiny_model(), folder)
    weights = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for k, w in weights.items():
        if w.ndim == 2 and w.is_floating_point():
            weights[k] = (w + 0.05 * w.std() * torch.randn(w.shape, generator=gen, dtype=w.dtype)).contiguous()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_weight_update_between_steps_reaches_every_replica_and_the_next_step(app):
    from transformers import AutoModelForCausalLM

    from rayapp.trainers.grpo import make_batch, token_logprobs

    folder = perturbed_checkpoint(app["roots"] / "step-1")
    replies = app["manager"].update_weights_from_disk.remote("student", str(folder)).result(timeout_s=STEP_S)
    assert len(replies) == 2 and all(r["ok"] and r["version"] == 1 for r in replies), replies

    samples = [s for s in samples_of(app["manager"].generate.remote(1).result(timeout_s=STEP_S))
               if s.response_length > 0]
    assert samples and versions(samples) == {1}  # every turn of the step on the new weights
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    b = make_batch(samples, [0.0] * len(samples))
    with torch.no_grad():
        new = token_logprobs(model, b.ids, b.attention)
    gap = float(((new - b.old_logp).abs() * b.mask).max())
    print(f"log-prob gap, SGLang vs transformers on the new weights: {gap:.2e}")
    assert gap < 1e-2  # sampled from the checkpoint's weights (SGLang's CPU kernels vs transformers')


def turn_versions(sample) -> list[int]:
    return [t["weight_version"] for t in sample.metadata["_turn_placement"]]


def test_a_partial_rollout_cuts_a_turn_and_the_next_step_resumes_it(app, tmp_path):
    """A second manager (recipe/partial.yaml: scheduler.partial, policy resume) over the same two
    engine replicas: rollout 1 completes with its short group and cuts the long one mid-turn, the
    checkpoint keeps what the cut turn made; new weights (version 2) load between the steps; rollout
    2 returns the long group first, each cut sample going on from its carried tokens on the new
    weights, every sample of either step returned once. Its steps are numbered 1 and 2, as the
    engines serve version 1 (the update test's), so a version reads as the step it belongs to."""
    import shutil

    from rayapp.actors.manager import SchedulerRolloutManager
    from rayapp.steps.checkpoint import RolloutCheckpoint

    serve = app["serve"]
    args = yaml.safe_load(PARTIAL.read_text())
    args["engines"] = app["args"]["engines"]
    args["data"]["cut"]["path"] = str(PARTIAL.with_name("partial_rows.jsonl"))
    args["scheduler"]["checkpoint_dir"] = str(tmp_path / "checkpoint")
    manager = serve.deployment(SchedulerRolloutManager, name="PartialRolloutManager", num_replicas=1,
                               ray_actor_options={"num_cpus": 0})
    handle = serve.run(manager.bind(args, {"student": app["engine"]}, None, "rayapp-partial"),
                       name="rayapp-partial", route_prefix=None)
    try:
        first = handle.generate.remote(1).result(timeout_s=STEP_S)
        assert [[s.task_id for s in g] for g in first.groups] == [["short-1", "short-1"]]
        assert first.metrics["rollout/partial/carried"] == 1.0
        [carried] = RolloutCheckpoint(tmp_path / "checkpoint").carried(1)
        assert carried.task.task_id == "long-1" and carried.since == 1
        cut = {s.index: s.episode.resume for s in carried.samples
               if s.status is Status.PENDING and s.episode.resume is not None and s.episode.resume.partial}
        assert cut, [(s.status, s.episode.resume) for s in carried.samples]  # a turn cut mid-generation
        for point in cut.values():
            assert point.turns == 0 and [t.weight_version for t in point.turn_records] == [1]
            assert len(point.tokens) == point.prompt_len + point.partial

        weights = shutil.copytree(ensure_tiny_model(), app["roots"] / "partial-2")
        replies = handle.update_weights_from_disk.remote("student", str(weights)).result(timeout_s=STEP_S)
        assert [r["version"] for r in replies] == [2, 2], replies

        second = handle.generate.remote(2).result(timeout_s=STEP_S)
        assert [[s.task_id for s in g] for g in second.groups] == [["long-1", "long-1"]]
        resumed = {s.index: s for s in second.groups[0]}
        assert sorted(resumed) == [0, 1]
        for index, point in cut.items():
            s = resumed[index]
            assert s.status in (Status.COMPLETED, Status.TRUNCATED), s.metadata
            assert s.tokens[:len(point.tokens)] == point.tokens  # the carried tokens begin the turn
            assert s.response_length >= point.partial
            assert s.rollout_log_probs[:point.partial] == point.rollout_log_probs[-point.partial:]
            assert turn_versions(s) == [1, 2]  # cut on the weights of step 1, finished on step 2's
        for s in carried.samples:  # a sample that had ended in rollout 1 comes back as it was
            if s.index not in cut and s.status is not Status.PENDING:
                assert resumed[s.index].tokens == s.tokens and turn_versions(resumed[s.index]) == [1]
        assert second.metrics["rollout/partial/resumed"] == 1.0
        assert second.metrics["rollout/partial/staleness_max"] == 1.0  # step 2 returns turns of step 1
        keys = [(s.task_id, s.index) for r in (first, second) for g in r.groups for s in g]
        assert len(keys) == len(set(keys)) == 4
        print(f"partial rollout: {len(cut)} sample(s) of long-1 cut in rollout 1 after "
              f"{sorted(p.partial for p in cut.values())} tokens, resumed in rollout 2 to "
              f"{sorted(resumed[i].response_length for i in cut)}")
    finally:
        serve.delete("rayapp-partial")


def test_an_engine_replica_killed_mid_step_still_returns_every_sample_once(app):
    ray, engine = app["ray"], app["engine"]
    step = app["manager"].generate.remote(2)
    wait_in_flight(engine, 1, timeout_s=STEP_S)
    replica = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                     if a["name"].startswith("SERVE_REPLICA::") and f"#{ENGINE}#" in a["name"])[0]
    ray.kill(ray.get_actor(replica, namespace="serve"))
    result = step.result(timeout_s=STEP_S)
    samples = samples_of(result)
    assert [len(g) for g in result.groups] == [2, 2, 2]
    keys = [(s.metadata.get("_group_id", gi), s.index) for gi, g in enumerate(result.groups) for s in g]
    assert len(set(keys)) == len(keys) == 6
    assert all(sorted(s.index for s in g) == [0, 1] for g in result.groups)
    aborted = [s for s in samples if s.status is Status.ABORTED]
    assert all(s.metadata["_termination_reason"] == "infra_conn" for s in aborted)
    print(f"replica killed mid-step: {len(aborted)} of 6 samples aborted (infra_conn), the rest completed")
