"""TRL's GRPOTrainer (trl==1.16.0, the ``trl`` extra) trains through ``rayapp.trainers.trl`` over an
in-process StepRunner (the real hf engine with the shipped tiny model, the local recipe's math-read
data): the trainer's batch is exactly rayapp's prompt and completion ids, log-probs and loss masks,
its loss is finite, the engine loads the trainer's weights at the start and after each step (so the
first rollout runs on the trainer's weights, not on what an earlier run left in the engine), and the
rollout ids follow the trainer's steps. The training tests are skipped where trl is not importable; the rows'
tests need no trl."""

import asyncio
import shutil
from types import SimpleNamespace as NS

import msgspec
import pytest
import torch
from agent_helpers import InProcessEngine
from safetensors.torch import load_file, save_file

from rayapp.cli import ROOT
from rayapp.core.contracts import RolloutResult
from rayapp.inference.hf import HFBackend
from rayapp.inference.tiny_model import SHIPPED
from rayapp.recipe import build_step_runner, load_recipe
from rayapp.trainers.sync import call as sync_call
from rayapp.trainers.trl import RayappRolloutFunc, ServeManager, WeightSyncCallback, rayapp_reward, to_trl
from rayapp.types import Sample, Status

GROUPS, G, STEPS = 4, 4, 2  # 4 groups of 4 a step: some group of the 8 has mixed scores (p > 0.9999)


class Recorded:
    """The step runner, keeping each result it handed the trainer."""

    def __init__(self, runner):
        self.runner, self.results, self.filters = runner, [], runner.filters

    async def rollout(self, rollout_id, tasks=None):
        result = await self.runner.rollout(rollout_id, tasks)
        self.results.append(result)
        return result

    async def evaluate(self, rollout_id):
        result = await self.runner.evaluate(rollout_id)
        self.results.append(result)
        return result


def step_runner(backend, eval_copies=None):
    """The local recipe's math-read data, 4 groups of 4 a step; with ``eval_copies``, its math-read
    eval set (4 prompts) that many copies each."""
    cfg = load_recipe(ROOT / "recipes" / "local" / "rollout.yaml")[1]
    data = {"math-read": msgspec.structs.replace(cfg.data["math-read"], n_samples_per_prompt=G)}
    scheduler = msgspec.structs.replace(cfg.scheduler, rollout_batch_size=GROUPS, save_eval_details=None,
                                        n_samples_per_eval_prompt=eval_copies or 1)
    evals = {"math-read": cfg.eval["math-read"]} if eval_copies else {}
    cfg = msgspec.structs.replace(cfg, data=data, eval=evals, scheduler=scheduler)

    async def inline(token, fn, *args):
        return fn(*args)

    async def no_sandbox(*args, **kwargs):
        raise AssertionError("math opens no sandbox")

    return build_step_runner(cfg, {"student": InProcessEngine(backend)}, None, executor=inline,
                             open_sandbox=no_sandbox)


def unpad(ids, mask):
    return [int(t) for t, m in zip(ids, mask, strict=True) if m]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'rayapp[trl]'")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("trl")
    model_dir = tmp / "model"
    shutil.copytree(SHIPPED, model_dir)  # training writes; the shipped model stays as it is
    backend = HFBackend(str(SHIPPED), max_concurrency=4, seed=0)
    batches = []

    class Trainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
            return out

    try:
        # an earlier run's final weights, left in the engine (its head scaled): the first rollout must not use them
        earlier = tmp / "earlier-run"
        shutil.copytree(SHIPPED, earlier)
        tensors = load_file(earlier / "model.safetensors")
        save_file({k: v * 3 if "lm_head" in k or "embed" in k else v for k, v in tensors.items()},
                  earlier / "model.safetensors")
        sync_call(backend.update_weights_from_disk, (str(earlier),), 600, "the earlier run's weights")
        source = Recorded(step_runner(backend))
        rollout_func = RayappRolloutFunc(source)
        sync = WeightSyncCallback(backend.update_weights_from_disk, tmp / "weights")
        args = trl.GRPOConfig(output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=GROUPS * G,
                              num_generations=G, learning_rate=1e-2, logging_steps=1, save_strategy="no",
                              report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          reward_funcs=[rayapp_reward], args=args, rollout_func=rollout_func,
                          # prompts come from rayapp's data source; these only count the groups
                          train_dataset=Dataset.from_dict({"prompt": ["(rayapp chooses)"] * 16}),
                          callbacks=[sync])
        trainer.train()
        yield {"source": source, "rollout_func": rollout_func, "sync": sync, "batches": batches,
               "trainer": trainer, "backend": backend}
    finally:
        backend.shutdown()


def test_the_trainer_trains_on_rayapps_tokens_masks_and_log_probs(trained):
    results, batches = trained["source"].results, trained["batches"]
    assert len(results) == len(batches) == STEPS
    for result, batch in zip(results, batches, strict=True):
        samples = [s for g in result.groups for s in g]
        assert len(samples) == GROUPS * G and all(len(g) == G for g in result.groups)
        for i, s in enumerate(samples):
            split = len(s.tokens) - s.response_length
            assert unpad(batch["prompt_ids"][i], batch["prompt_mask"][i]) == s.tokens[:split]
            assert unpad(batch["completion_ids"][i], batch["completion_mask"][i]) == s.tokens[split:]
            n = s.response_length
            assert batch["tool_mask"][i][:n].tolist() == s.loss_mask
            assert batch["sampling_per_token_logps"][i][:n].tolist() == pytest.approx(s.rollout_log_probs)
        # the advantages are the group-normalised rayapp scores
        scores = torch.tensor([s.reward["score"] for s in samples]).view(GROUPS, G)
        centred = (scores - scores.mean(dim=1, keepdim=True)).flatten()
        assert torch.equal(batch["advantages"] != 0, centred != 0)


def test_its_loss_is_finite_and_a_group_had_signal(trained):
    losses = [row["loss"] for row in trained["trainer"].state.log_history if "loss" in row]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses))), losses
    assert any((b["advantages"] != 0).any() for b in trained["batches"]), "no group with mixed scores: no gradient"


def test_the_engine_loads_the_trainers_weights_at_the_start_and_after_each_step(trained):
    sync, backend = trained["sync"], trained["backend"]
    assert [step for step, _ in sync.synced] == list(range(0, STEPS + 1))
    assert backend.info()["weight_version"] == 1 + STEPS + 1  # the earlier run's, the start's, each step's
    live = trained["trainer"].model.state_dict()
    last = load_file(f"{sync.synced[-1][1]}/model.safetensors")
    assert all(torch.equal(live[k], last[k]) for k in last)
    served = backend.model.state_dict()
    assert all(torch.equal(live[k], served[k]) for k in last)  # the engine serves what the trainer has
    original = load_file(SHIPPED / "model.safetensors")
    assert any(not torch.equal(original[k], last[k]) for k in original)


def test_the_first_rollout_runs_on_the_trainers_weights_not_the_earlier_runs(trained):
    sync, results = trained["sync"], trained["source"].results
    start = load_file(f"{sync.synced[0][1]}/model.safetensors")
    original = load_file(SHIPPED / "model.safetensors")
    assert all(torch.equal(original[k], start[k]) for k in original)  # what the trainer started from
    for step, result in enumerate(results):
        versions = {t["weight_version"] for g in result.groups for s in g for t in s.metadata["_turn_placement"]}
        assert versions == {2 + step}, (step, versions)  # 1 was the earlier run's


def test_rollout_ids_follow_the_trainers_steps(trained):
    assert trained["rollout_func"].asked == [(s, s) for s in range(STEPS)]
    assert [r.rollout_id for r in trained["source"].results] == list(range(STEPS))


def sample(index, tokens, n, mask, score=1.0, status=Status.COMPLETED):
    return Sample("t", index, "p", tokens=tokens, response_length=n, loss_mask=mask, status=status,
                  rollout_log_probs=[-0.5] * len(mask), reward={} if score is None else {"score": score})


def test_a_multi_turn_sample_keeps_its_tool_tokens_out_of_the_loss_and_an_abort_gets_no_reward():
    turns = sample(0, [1, 2, 3, 4, 5, 6, 7], 5, [1, 1, 0, 0, 1], score=1.0)  # prompt 1 2, tool result 5 6
    aborted = sample(1, [1, 2], 0, [], score=None, status=Status.ABORTED)
    cut = sample(2, [1, 2, 8, 9], 2, [1, 1], score=0.0, status=Status.ABORTED)  # aborted mid-reply
    rows = to_trl(RolloutResult(3, [[turns, aborted, cut]]), 3, 3, pad_id=99)
    assert rows["prompt_ids"] == [[1, 2]] * 3
    assert rows["completion_ids"] == [[3, 4, 5, 6, 7], [99], [8, 9]]
    assert rows["env_mask"] == [[1, 1, 0, 0, 1], [0], [0, 0]] and rows["logprobs"][0] == [-0.5] * 5
    assert rows["rayapp_score"] == [1.0, None, None]  # TRL: an all-None row gets advantage 0, out of the baseline
    assert rayapp_reward(["a", "b", "c"], rows["rayapp_score"]) == [1.0, None, None]


def test_groups_off_num_generations_and_bad_samples_are_one_clear_error():
    ok = sample(0, [1, 2, 3], 1, [1])
    with pytest.raises(ValueError, match=r"rollout 7: groups of \[1, 2\] samples.*num_generations=2"):
        to_trl(RolloutResult(7, [[ok], [ok, ok]]), 2, 4)
    with pytest.raises(ValueError, match="rollout 7, group 0, sample t#0: response_length 2, 1 loss_mask entries"):
        to_trl(RolloutResult(7, [[sample(0, [1, 2, 3], 2, [1])]]), 1, 1)
    with pytest.raises(ValueError, match=r"no reward\['score'\]"):
        to_trl(RolloutResult(7, [[sample(0, [1, 2, 3], 1, [1], score=None)]]), 1, 1)


def fake_trainer(global_step=0, per_generation=1, iterations=1, accumulation=1):
    args = NS(steps_per_generation=per_generation, num_iterations=iterations, gradient_accumulation_steps=accumulation)
    return NS(args=args, state=NS(global_step=global_step), accelerator=NS(num_processes=1), model=NS(training=True),
              num_generations=1, processing_class=NS(pad_token_id=0), tools=None)


def test_a_restarted_trainer_asks_for_the_rollout_of_the_step_it_is_at():
    func = RayappRolloutFunc(NS(rollout=lambda i: None), first_rollout_id=10)
    # 4 micro-steps per generation, 2 per optimizer step: one rollout feeds 2 optimizer steps
    assert [func.rollout_id(fake_trainer(s, 4, 1, 2)) for s in range(6)] == [10, 10, 11, 11, 12, 12]
    assert [func.rollout_id(fake_trainer(s, 1, 2, 1)) for s in range(4)] == [10, 10, 11, 11]  # num_iterations 2
    with pytest.raises(ValueError, match=r"steps_per_generation \* num_iterations \(3\) must be a multiple of "
                                         r"gradient_accumulation_steps \(2\)"):
        func.rollout_id(fake_trainer(0, 3, 1, 2))


def test_a_source_that_does_not_answer_in_time_is_a_timeout_naming_the_step():
    class Stuck:
        async def rollout(self, rollout_id):
            await asyncio.sleep(60)

    with pytest.raises(TimeoutError, match=r"rollout 5 did not finish within 0\.2s"):
        RayappRolloutFunc(Stuck(), first_rollout_id=5, timeout_s=0.2)([], fake_trainer())


def test_the_serve_manager_wrapper_puts_a_timeout_on_every_call():
    calls = []

    def method(name):
        def remote(*args):
            return NS(result=lambda timeout_s: calls.append((name, args, timeout_s)) or [{"ok": True}])
        return NS(remote=remote)

    manager = ServeManager(NS(generate=method("generate"), evaluate=method("evaluate"),
                              update_weights_from_disk=method("update")), engine="student", timeout_s=42)
    manager.rollout(3)
    manager.rollout(4, ["task"])
    manager.evaluate(4)
    manager.update_weights("/w/step-000001")
    assert calls == [("generate", (3,), 42), ("generate", (4, ["task"]), 42), ("evaluate", (4,), 42),
                     ("update", ("student", "/w/step-000001"), 42)]


def test_a_step_runner_with_survivorship_filters_is_refused():
    with pytest.raises(ValueError, match="survivorship filters"):
        RayappRolloutFunc(NS(rollout=lambda i: None, filters=["rejection"]))
