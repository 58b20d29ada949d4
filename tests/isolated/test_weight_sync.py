"""Weight sync through the manager, on the Serve app: a trainer's checkpoint reaches every replica of
the engine, later samples record the new weight version on each model turn, and they were sampled
from the new weights (their log-probs are the checkpoint's). On the isolated files' shared Ray head (conftest.py)."""

import time

import pytest
import torch
import yaml
from shared_head import serve_app

from rayapp.cli import ROOT
from rayapp.trainers.grpo import GRPOTrainer, make_batch, token_logprobs


@pytest.fixture(scope="module")
def handle(head, tmp_path_factory, model_dir):
    import ray
    from ray import serve

    # the replicas serve the session's tiny model (the shipped one, or built in cache_dir) and keep tokenizer
    # files there, never beside the shipped model in rayapp's own folder
    tmp = tmp_path_factory.mktemp("sync")
    cfg = yaml.safe_load((ROOT / "recipes" / "train_grpo" / "rollout.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["data"]["math"] |= {"n_prompts": 8, "n_samples_per_prompt": 2}
    args["scheduler"]["rollout_batch_size"] = 3
    args["engines"]["student"]["weight_roots"] = [str(tmp_path_factory.getbasetemp())]  # the tests' checkpoints
    with serve_app(head, cfg, tmp):
        ray.init(address=head.address, namespace="rayapp-sync", logging_level="error", log_to_driver=False)
        try:
            yield serve.get_app_handle("rayapp")
        finally:
            ray.shutdown()


def versions(result) -> set[int]:
    return {t["weight_version"] for g in result.groups for s in g for t in s.metadata["_turn_placement"]}


def test_every_replica_loads_the_checkpoint_and_later_samples_record_and_use_it(handle, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    first = handle.generate.remote(0).result(timeout_s=600)
    assert versions(first) == {0}

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()
    trainer = GRPOTrainer(model, lr=5e-2, micro_steps=1)
    for i, g in enumerate(first.groups):  # a made-up reward: any update will do, as long as one happens
        for s in g:
            s.reward = {"score": float((s.index + i) % 2)}
    assert trainer.step(first.groups)["logprob_diff_first"] < 1e-4
    folder = trainer.save(tmp_path / "step-1")

    replies = handle.update_weights_from_disk.remote("student", str(folder)).result(timeout_s=600)
    assert len(replies) == 2  # the recipe's two replicas, each answering for itself
    assert all(r["ok"] and r["version"] == 1 and r["path"] == str(folder) for r in replies)

    second = handle.generate.remote(1).result(timeout_s=600)
    assert versions(second) == {1}
    samples = [s for g in second.groups for s in g if s.response_length > 0]
    b = make_batch(samples, [0.0] * len(samples))
    with torch.no_grad():
        new = token_logprobs(model, b.ids, b.attention)
    assert float(((new - b.old_logp).abs() * b.mask).max()) < 1e-4  # sampled from the trained weights

    with pytest.raises(Exception, match="unknown engine"):
        handle.update_weights_from_disk.remote("teacher", str(folder)).result(timeout_s=60)
    with pytest.raises(Exception, match="outside the engine's weight_roots"):  # refused by name, nothing changed
        handle.update_weights_from_disk.remote("student", str(model_dir)).result(timeout_s=60)

    # Issue 19 point 5: a replica killed after the update comes back on the updated weights.
    import ray

    def replicas() -> list[str]:
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith("SERVE_REPLICA::") and "#engine-student#" in a["name"])

    before = replicas()
    ray.kill(ray.get_actor(before[0], namespace="serve"))
    deadline = time.monotonic() + 120
    while not (len(now := replicas()) == 2 and before[0] not in now) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(now) == 2 and before[0] not in now, now
    third = handle.generate.remote(2).result(timeout_s=600)
    assert versions(third) == {1}  # every turn on the updated weights, the replacement's too
