"""verl 0.9.1's own ``RayPPOTrainer.fit()`` takes its rollouts from rayapp through ``rayapp.trainers.verl``.

fit() runs as verl ships it, for 2 steps on CPU: its RLHFDataset over a parquet file and its stateful
dataloader, the uid it gives each prompt, ``_get_gen_batch``, ``repeat(n, interleave=True)``, the
``union`` with the adapter's output, ``extract_reward``, the rollout-correction bypass (old log-probs
= rayapp's), ``compute_advantage`` (GRPO), its metrics and logger, and the weight-sync calls. The
adapter's source is an in-process StepRunner (the real hf engine, the shipped tiny model, the local
recipe's math evaluator). Stand-ins, for what needs GPUs and torch.distributed: the actor's worker
group (it records what fit() sends it, and saves Hugging Face weights of a model whose head it scales,
so the engine's load is checked) and the resource pool (its GPU count, for a throughput metric). A
second trainer resumed from fit()'s own checkpoint asks for the same step and is served its result.
Skipped without verl (docs/trainers.md says how it is installed beside the project)."""

from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch

pytest.importorskip("verl", reason="verl is an optional extra (docs/trainers.md, verl)")

import pyarrow as pa
import pyarrow.parquet as pq
import verl
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_trainer_trl import step_runner
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.utils import Role
from verl.utils import tensordict_utils as tu
from verl.utils.import_utils import load_class_from_fqn

from rayapp.core.contracts import RolloutResult
from rayapp.envs.math import tool_result_rows
from rayapp.inference.hf import HFBackend
from rayapp.inference.tiny_model import SHIPPED
from rayapp.trainers.verl import RayappAgentLoopManager, RayappCheckpointManager, fit_batch, group_uids
from rayapp.types import Sample, Status, TaskKey

PROMPTS, N, STEPS = 4, 4, 2  # 4 prompts of 4 samples a step, 8 rows: 2 steps in the epoch
ADAPTER = "rayapp.trainers.verl.RayappAgentLoopManager"


class Recorded:
    """The step runner as the adapter's source, keeping each result and the tasks it was given."""

    def __init__(self, runner, backend):
        self.runner, self.backend, self.results, self.tasks = runner, backend, [], []

    async def rollout(self, rollout_id, tasks):
        self.tasks.append(tasks)
        result = await self.runner.rollout(rollout_id, tasks)
        self.results.append(result)
        return result

    async def update_weights(self, path):
        return await self.backend.update_weights_from_disk(path)


class ActorStandIn:
    """verl's FSDP actor worker group (GPUs, torch.distributed): records the no-padding batches fit()
    hands ``update_actor``; ``save_checkpoint`` writes ``huggingface/`` as verl's does with hf_model."""

    def __init__(self):
        self.model = AutoModelForCausalLM.from_pretrained(SHIPPED)
        self.updates, self.saved = [], []

    def update_actor(self, batch_td):
        self.updates.append(batch_td)
        with torch.no_grad():
            self.model.lm_head.weight.mul_(1.01)  # a known change the engine must then serve
        return tu.get_tensordict({}, {"metrics": {"mfu": 0.0, "pg_loss": 0.0}})

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.saved.append((local_path, global_step, max_ckpt_to_keep))
        self.model.save_pretrained(Path(local_path) / "huggingface")

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        self.model = AutoModelForCausalLM.from_pretrained(Path(local_path) / "huggingface")


def verl_config(tmp, data):
    cfg = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml")
    overrides = {
        "data": {"train_files": str(data), "val_files": str(data), "train_batch_size": PROMPTS,
                 "dataloader_num_workers": 0, "max_prompt_length": 512, "max_response_length": 512, "shuffle": False},
        "actor_rollout_ref": {
            "model": {"path": str(SHIPPED)},
            "actor": {"ppo_mini_batch_size": PROMPTS, "use_kl_loss": False},
            "rollout": {"n": N, "prompt_length": 512, "response_length": 512,
                        "agent": {"agent_loop_manager_class": ADAPTER},
                        "checkpoint_manager_class": "rayapp.trainers.verl.RayappCheckpointManager"}},
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False,
                      "rollout_correction": {"bypass_mode": True}},
        "trainer": {"use_v1": False, "total_epochs": 1, "val_before_train": False, "test_freq": -1, "save_freq": 1,
                    "logger": ["console"], "balance_batch": False, "resume_mode": "disable",
                    "default_local_dir": str(tmp / "ckpt"), "device": "cpu"},
        "rayapp": {"task_type": "math"},
    }
    return OmegaConf.merge(cfg, OmegaConf.create(overrides))


def write_rows(path):
    """verl's dataset shape (its gsm8k preprocessing): prompt messages, data_source, reward_model, extra_info."""
    tasks = tool_result_rows(NS(n_prompts=PROMPTS * STEPS, seed=0))
    rows = [{"prompt": t.prompt, "data_source": "math-read", "reward_model": {"style": "rule", "ground_truth": t.label},
             "extra_info": {"index": i, "split": "train"}} for i, t in enumerate(tasks)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return tasks


class Trainer(RayPPOTrainer):
    """verl's own trainer; two of its methods wrapped only to keep what they were given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def _get_gen_batch(self, batch):
        self.seen.append({"batch_uids": list(batch.non_tensor_batch["uid"])})
        return super()._get_gen_batch(batch)

    def _update_actor(self, batch):
        self.seen[-1]["batch"] = batch
        return super()._update_actor(batch)


def run_fit(cfg, source, actor):
    """fit() after what init_workers does once the (GPU) worker groups exist: the rollout and
    weight-sync managers built from the config's dotted paths, verl's replicas put to sleep."""
    trainer = Trainer(cfg, AutoTokenizer.from_pretrained(SHIPPED), role_worker_mapping={Role.ActorRollout: object},
                      resource_pool_manager=NS(get_n_gpus=lambda: 1))
    trainer.actor_rollout_wg = actor
    manager_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager")
    trainer.async_rollout_manager = manager_cls.create(config=cfg, llm_client=None, teacher_client=None,
                                                       reward_loop_worker_handles=None, source=source)
    sync_cls = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "CheckpointEngineManager")
    trainer.checkpoint_manager = sync_cls(config=None, actor_wg=actor, replicas=[])
    trainer.checkpoint_manager.sleep_replicas()
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl")
    tasks = write_rows(tmp / "train.parquet")
    backend = HFBackend(str(SHIPPED), max_concurrency=4, seed=0)
    try:
        cfg = verl_config(tmp, tmp / "train.parquet")
        source, actor = Recorded(step_runner(backend), backend), ActorStandIn()
        trainer = run_fit(cfg, source, actor)
        yield {"trainer": trainer, "source": source, "actor": actor, "backend": backend, "seen": trainer.seen,
               "tasks": tasks, "cfg": cfg, "tmp": tmp}
    finally:
        backend.shutdown()


def test_fit_ran_its_steps_on_rayapps_rollouts_of_its_own_prompts(fitted):
    source, seen, tasks = fitted["source"], fitted["seen"], fitted["tasks"]
    assert fitted["trainer"].async_rollout_manager.asked == [(1, 0), (2, 1)]  # fit()'s step s is rollout s-1
    assert [r.rollout_id for r in source.results] == [0, 1] and len(seen) == STEPS
    for step, given in enumerate(source.tasks):  # the dataloader's prompts, in its order, n samples each
        rows = tasks[step * PROMPTS:(step + 1) * PROMPTS]
        assert [t.prompt for t in given] == [t.prompt for t in rows]
        assert [t.label for t in given] == [t.label for t in rows]
        assert {t.config.task_type for t in given} == {"math"} and {t.config.n_samples for t in given} == {N}


def test_the_uid_join_puts_each_rayapp_group_on_its_prompts_rows(fitted):
    for result, step in zip(fitted["source"].results, fitted["seen"], strict=True):
        batch = step["batch"]  # after fit()'s repeat + union, reward extraction and advantages
        uids = batch.non_tensor_batch["uid"]
        assert list(uids) == [u for u in step["batch_uids"] for _ in range(N)]  # verl's uuid4s, in its order
        samples = [s for g in result.groups for s in g]
        assert len(batch) == len(samples) == PROMPTS * N
        prompts, responses = batch.batch["prompts"], batch.batch["responses"]
        for i, s in enumerate(samples):
            group = int(s.metadata[TaskKey.GROUP_ID.value].split("/")[1])
            assert uids[i] == step["batch_uids"][group]
            cut = len(s.tokens) - s.response_length
            p_mask, r_mask = batch.batch["attention_mask"][i].split([prompts.shape[1], responses.shape[1]])
            assert prompts[i][p_mask.bool()].tolist() == s.tokens[:cut]
            assert responses[i][r_mask.bool()].tolist() == s.tokens[cut:]
            assert batch.batch["response_mask"][i][: s.response_length].tolist() == s.loss_mask
            # the rollout-correction bypass: verl's old log-probs are rayapp's
            lp = batch.batch["old_log_probs"][i][: s.response_length]
            assert lp.tolist() == pytest.approx(s.rollout_log_probs)
        # the data set's columns stayed on the rows (fit()'s union kept both sides)
        assert set(batch.non_tensor_batch["data_source"]) == {"math-read"}


def test_rewards_reach_verls_advantages_grouped_by_rayapps_groups(fitted):
    some_signal = False
    for result, step in zip(fitted["source"].results, fitted["seen"], strict=True):
        batch = step["batch"]
        scores = torch.tensor([s.reward["score"] for g in result.groups for s in g])
        # extract_reward read rm_scores: token_level_scores hold each score on its last response token
        assert torch.equal(batch.batch["token_level_scores"].sum(-1), scores)
        assert torch.equal(batch.batch["token_level_rewards"], batch.batch["token_level_scores"])
        adv = batch.batch["advantages"]
        mask = batch.batch["response_mask"].bool()
        assert (adv[~mask] == 0).all()
        centred = (scores.view(PROMPTS, N) - scores.view(PROMPTS, N).mean(1, keepdim=True)).flatten()
        for i in range(len(scores)):  # GRPO: above its group's mean pushed up, below pushed down
            row = adv[i][mask[i]]
            assert (torch.sign(row) == torch.sign(centred[i])).all()
        some_signal |= bool((centred != 0).any())
    assert some_signal, "no group with mixed scores in 2 steps"


def test_weights_reach_the_engine_at_every_step_and_the_next_step_runs_on_them(fitted):
    sync, actor, backend = fitted["trainer"].checkpoint_manager, fitted["actor"], fitted["backend"]
    # fit() syncs before training (step 0) and after each update; verl's rotation never sees these saves
    assert [step for step, _ in sync.synced] == [0, 1, 2]
    assert [keep for path, _, keep in actor.saved if "rayapp_weights" in path] == [None] * 3
    assert backend.info()["weight_version"] == 3
    served, live = backend.model.state_dict(), actor.model.state_dict()
    assert all(torch.equal(served[k], live[k]) for k in load_file(Path(sync.synced[-1][1]) / "model.safetensors"))
    assert not Path(sync.synced[0][1]).exists() and Path(sync.synced[-1][1]).exists()  # the folder before removed
    versions = [{t["weight_version"] for s in g for t in s.metadata["_turn_placement"]}
                for r in fitted["source"].results for g in r.groups]
    assert set().union(*versions[:PROMPTS]) == {1} and set().union(*versions[PROMPTS:]) == {2}


def test_a_trainer_resumed_from_its_checkpoint_asks_for_the_same_step_and_is_served_its_result(fitted):
    # fit() saved global_step_1 (its actor and its dataloader's position); a new trainer resumes from it
    cfg = fitted["cfg"].copy()
    cfg.trainer.resume_mode = "resume_path"
    cfg.trainer.resume_from_path = str(fitted["tmp"] / "ckpt" / "global_step_1")
    source = fitted["source"]
    resumed = run_fit(cfg, source, ActorStandIn())
    assert resumed.async_rollout_manager.asked == [(2, 1)]  # the step it was at: rollout 1 again
    assert source.tasks[-1] == source.tasks[1]  # the same rows from the restored dataloader: the same tasks
    assert source.results[-1] == source.results[1]  # rayapp served the step's result, not a new rollout
    assert resumed.seen[0]["batch"].batch["token_level_scores"].sum().item() == sum(
        s.reward["score"] for g in source.results[1].groups for s in g)


def sample(task, index, tokens, n, score=1.0, status=Status.COMPLETED, group="3/0"):
    return Sample(task, index, "p", tokens=tokens, response_length=n, loss_mask=[1] * n, status=status,
                  rollout_log_probs=[-0.5] * n, reward={} if score is None else {"score": score},
                  metadata={TaskKey.GROUP_ID.value: group})


def test_groups_come_back_in_the_prompts_order_and_an_abort_is_out_of_the_loss():
    # the step returned task 1's group first: rows still follow the prompts
    second = [sample("b", 0, [5, 6, 7], 1, 0.0, group="3/1"), sample("b", 1, [5, 8], 1, 1.0, group="3/1")]
    first = [sample("a", 0, [1, 2, 3], 1, 1.0), sample("a", 1, [1, 2, 4], 1, None, Status.ABORTED)]
    out = fit_batch(RolloutResult(3, [second, first]), ["ua", "ub"], 2, prompt_length=4, response_length=3)
    assert list(out.non_tensor_batch["uid"]) == ["ua", "ua", "ub", "ub"]
    assert list(out.non_tensor_batch["rayapp_task_id"]) == ["a", "a", "b", "b"]
    assert out.batch["rm_scores"][:, 0].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert out.batch["response_mask"][:, 0].tolist() == [1, 0, 1, 1]  # the aborted sample: row kept, no loss
    assert out.meta_info["reward_extra_keys"] == ["score"]


def test_a_step_that_does_not_cover_every_prompt_with_n_samples_is_one_error():
    one = [sample("a", 0, [1, 2], 1), sample("a", 1, [1, 3], 1)]
    with pytest.raises(ValueError, match=r"rollout 3: groups of \[2, 0\] samples for 2 prompts.*n=2"):
        fit_batch(RolloutResult(3, [one]), ["ua", "ub"], 2)
    with pytest.raises(ValueError, match="names no task of this step"):
        fit_batch(RolloutResult(4, [one]), ["ua"], 2)


def gen_batch(uids, meta=None):
    from verl import DataProto

    cells = {"uid": np.array(uids, dtype=object),
             "raw_prompt": np.array([[{"role": "user", "content": "q"}]] * len(uids) + [None], dtype=object)[:-1]}
    return DataProto.from_dict(tensors={"dummy_tensor": torch.zeros(len(uids), 1)}, non_tensors=cells,
                               meta_info=meta or {"global_steps": 1})


def test_uids_must_be_fits_runs_and_validation_and_remax_are_refused():
    assert group_uids(gen_batch(["a", "a", "b", "b"]), "x") == (["a", "b"], 2)
    with pytest.raises(ValueError, match="not runs of one size"):
        group_uids(gen_batch(["a", "a", "b"]), "x")
    with pytest.raises(ValueError, match="not runs of one size"):
        group_uids(gen_batch(["a", "b", "a", "b"]), "x")
    cfg = verl_config(Path("/nonexistent"), "unused")
    manager = RayappAgentLoopManager(cfg, source=NS(rollout=None))
    with pytest.raises(ValueError, match=r"val_before_train=False and trainer\.test_freq=-1"):
        manager.generate_sequences(gen_batch(["a"], {"global_steps": 1, "validate": True}))
    remax = gen_batch(["a"])
    remax.non_tensor_batch["__do_sample__"] = np.ones(1, dtype=bool)
    with pytest.raises(ValueError, match="REMAX"):
        manager.generate_sequences(remax)


def test_verls_v1_trainer_is_refused_saying_what_to_set(tmp_path):
    cfg = verl_config(tmp_path, "unused")
    cfg.trainer.use_v1 = True  # verl 0.9.1's default
    with pytest.raises(ValueError, match=r"RayPPOTrainer\.fit\(\): set trainer\.use_v1=False"):
        RayappAgentLoopManager(cfg, source=NS())


def test_a_bad_rayapp_section_is_one_error_naming_its_key(tmp_path):
    cfg = verl_config(tmp_path, "unused")
    cfg.rayapp = {"task_typ": "math"}
    with pytest.raises(ValueError, match=r"verl config: \$\.rayapp.*task_typ"):
        RayappAgentLoopManager(cfg, source=NS())


def test_the_checkpoint_manager_says_what_to_set_when_the_actor_saves_no_hf_model(tmp_path):
    cfg = verl_config(tmp_path, "unused")
    RayappAgentLoopManager(cfg, source=NS(update_weights=lambda path: [{"ok": True}]))
    sync = RayappCheckpointManager(actor_wg=NS(save_checkpoint=lambda *a, **k: None))
    with pytest.raises(ValueError, match=r"add 'hf_model' to actor_rollout_ref\.actor\.checkpoint\.save_contents"):
        sync.update_weights(1)
