"""TRL's GRPOTrainer (trl==1.16.0, the ``trl`` extra) trains through ``rayapp.trainers.trl`` against the Serve app,
whose engine has two replicas: each step's rollout comes through the manager's handle (``ServeManager``), the
trainer's batch is exactly rayapp's prompt and completion ids, loss masks and log-probs, and at the start and after
each optimiser step ``WeightSyncCallback`` puts the trainer's weights on both replicas, so that every turn of the
next step runs on them (its version on every turn, its log-probs the trainer's weights') and both replicas answer
turns. Skipped without trl (docs/trainers.md, TRL); on the isolated files' shared Ray head (conftest.py)."""


import pytest
import torch
import yaml

trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'rayapp[trl]'")

from shared_head import serve_app  # noqa: E402

from rayapp.cli import ROOT  # noqa: E402
from rayapp.trainers.grpo import make_batch, token_logprobs  # noqa: E402
from rayapp.trainers.trl import RayappRolloutFunc, ServeManager, WeightSyncCallback, rayapp_reward  # noqa: E402
from rayapp.types import Status  # noqa: E402

GROUPS, G, STEPS = 3, 2, 3  # 3 prompts x 2 samples a step


@pytest.fixture(scope="module")
def app(head, tmp_path_factory):
    import ray
    from ray import serve

    tmp = tmp_path_factory.mktemp("trl-serve")
    cfg = yaml.safe_load((ROOT / "recipes" / "train_grpo" / "rollout.yaml").read_text())
    args = cfg["applications"][0]["args"]
    assert args["engines"]["student"]["num_replicas"] == 2
    args["data"]["math"] |= {"n_prompts": 16, "n_samples_per_prompt": G}
    args["eval"] = {"math": args["eval"]["math"] | {"n_prompts": 2}}
    args["scheduler"]["rollout_batch_size"] = GROUPS
    args["engines"]["student"]["weight_roots"] = [str(tmp)]  # where this test's trainer saves
    with serve_app(head, cfg, tmp):
        ray.init(address=head.address, namespace="rayapp-trl", logging_level="error", log_to_driver=False)
        try:
            yield tmp, serve.get_app_handle("rayapp")
        finally:
            ray.shutdown()


class Recorded:
    """The manager through its handle, keeping each step it handed the trainer and each update's replies."""

    def __init__(self, manager: ServeManager):
        self.manager, self.results, self.updates = manager, [], []

    def rollout(self, rollout_id, tasks=None):
        self.results.append(self.manager.rollout(rollout_id, tasks))
        return self.results[-1]

    def update_weights(self, path):
        self.updates.append(self.manager.update_weights(path))
        return self.updates[-1]


def alternating(completions, **kwargs):
    """A second reward (TRL adds it to rayapp's score) that gives every group a spread, so every step
    has a gradient and moves the weights whatever the tiny model's answers score."""
    return [float(i % 2) for i in range(len(completions))]


@pytest.fixture(scope="module")
def trained(app, model_dir):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp, handle = app
    batches = []

    class Trainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
            return out

    source = Recorded(ServeManager(handle, timeout_s=600))
    rollout_func = RayappRolloutFunc(source, timeout_s=600)
    sync = WeightSyncCallback(source.update_weights, tmp / "weights", timeout_s=600)
    args = trl.GRPOConfig(output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=GROUPS * G,
                          num_generations=G, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                          report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True),
                      processing_class=AutoTokenizer.from_pretrained(model_dir, local_files_only=True),
                      reward_funcs=[rayapp_reward, alternating], args=args, rollout_func=rollout_func,
                      # prompts come from rayapp's data source; these only count the groups
                      train_dataset=Dataset.from_dict({"prompt": ["(rayapp chooses)"] * GROUPS}),
                      callbacks=[sync])
    trainer.train()
    return {"source": source, "rollout_func": rollout_func, "sync": sync, "batches": batches, "trainer": trainer}


def unpad(ids, mask):
    return [int(t) for t, m in zip(ids, mask, strict=True) if m]


def test_the_trainers_loss_is_on_rayapps_tokens_masks_and_log_probs(trained):
    results, batches = trained["source"].results, trained["batches"]
    pad = trained["trainer"].processing_class.pad_token_id or 0
    assert trained["rollout_func"].asked == [(s, s) for s in range(STEPS)]  # rollout id = the trainer's step
    assert [r.rollout_id for r in results] == list(range(STEPS)) and len(batches) == STEPS
    for result, batch in zip(results, batches, strict=True):
        samples = [s for g in result.groups for s in g]
        assert len(result.groups) == GROUPS and all(len(g) == G for g in result.groups)
        for i, s in enumerate(samples):
            split = len(s.tokens) - s.response_length
            assert unpad(batch["prompt_ids"][i], batch["prompt_mask"][i]) == s.tokens[:split]
            n = s.response_length
            # a sample without a completion stays in its group as one masked pad token
            assert unpad(batch["completion_ids"][i], batch["completion_mask"][i]) == (s.tokens[split:] or [pad])
            if s.status is Status.ABORTED:  # e.g. a verifier that gave no answer in time: nothing to learn
                assert not batch["tool_mask"][i].any()
                continue
            assert batch["tool_mask"][i][:n].tolist() == s.loss_mask  # TRL's loss mask is completion x tool
            assert batch["sampling_per_token_logps"][i][:n].tolist() == pytest.approx(s.rollout_log_probs)
        assert (batch["advantages"] != 0).any()
    losses = [row["loss"] for row in trained["trainer"].state.log_history if "loss" in row]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses


def versions(result) -> set[int]:
    return {t["weight_version"] for g in result.groups for s in g for t in s.metadata["_turn_placement"]}


def test_each_update_reaches_both_replicas_and_the_next_step_runs_on_it(trained, model_dir):
    from transformers import AutoModelForCausalLM

    source, sync = trained["source"], trained["sync"]
    assert [step for step, _ in sync.synced] == list(range(0, STEPS + 1))  # the start's, then each step's
    for i, replies in enumerate(source.updates):
        assert len(replies) == 2, replies  # the recipe's two replicas, each answering for itself
        assert all(r["ok"] and r["version"] == i + 1 and r["path"] == sync.synced[i][1] for r in replies)
    for k, result in enumerate(source.results):
        assert versions(result) == {k + 1}  # every turn of step k on the weights of optimiser step k (0: the start's)
    engines = {t["engine"] for r in source.results for g in r.groups for s in g for t in s.metadata["_turn_placement"]}
    replica = "hf@engine-student#"  # the backend @ the Serve replica that answered
    assert len(engines) == 2 and all(e.startswith(replica) for e in engines), engines
    original = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).state_dict()
    for k in range(STEPS):  # sampled from the trainer's weights: the log-probs of the folder step k saved
        model = AutoModelForCausalLM.from_pretrained(sync.synced[k][1], local_files_only=True).eval()
        moved = any(not torch.equal(original[n], w) for n, w in model.state_dict().items())
        assert moved == (k > 0)  # the start's are the model's own; then the weights moved
        samples = [s for g in source.results[k].groups for s in g if s.response_length > 0]
        b = make_batch(samples, [0.0] * len(samples))
        with torch.no_grad():
            new = token_logprobs(model, b.ids, b.attention)
        assert float(((new - b.old_logp).abs() * b.mask).max()) < 1e-4
