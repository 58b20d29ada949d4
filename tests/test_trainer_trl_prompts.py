"""TRL's GRPOTrainer with its own prompts (``RayappRolloutFunc(source, prompts=TrainerPrompts(...))``) and
its eval loop served by rayapp's eval step: each generation runs the trainer's prompts, in order, as
the rollout step's tasks with their rows' labels, so row i of the batch is a completion of TRL's row i;
``trainer.evaluate()`` hands out rayapp's eval step batch by batch and logs its metrics. The training
test is skipped where trl is not importable; the others need no trl."""

import math
from types import SimpleNamespace as NS

import pytest
from test_trainer_trl import GROUPS, G, Recorded, step_runner

from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.envs.datasets.files import FieldMap
from rayapp.envs.math import tool_result_rows
from rayapp.inference.hf import HFBackend
from rayapp.inference.tiny_model import SHIPPED
from rayapp.trainers.trl import EVAL_FIELD, RayappRolloutFunc, eval_rows, rayapp_eval_prompts, rayapp_reward
from rayapp.trainers.trl_tasks import TrainerPrompts
from rayapp.types import Sample, Status, Task, TaskConfig

STEPS, EVAL_COPIES, EVAL_PROMPTS = 2, 2, 4  # the recipe's math-read eval set has 4 prompts
FIELDS = FieldMap(label="answer", metadata=["question"])


def dataset_rows(n=8):
    """A trainer's dataset: the math-read problems as a TRL user would hold them (prompt, answer, question)."""
    return [{"prompt": t.prompt, "answer": t.label, "question": t.metadata["question"]}
            for t in tool_result_rows(NS(n_prompts=n, seed=7))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    trl = pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'rayapp[trl]'")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("trl-prompts")
    backend = HFBackend(str(SHIPPED), max_concurrency=4, seed=0)
    batches, seen = [], []

    class Trainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            batches.append([dict(x) for x in inputs])  # what TRL's dataloader gave, before rayapp's fields join
            return super()._generate_and_score_completions(inputs)

    def own_reward(completions, rayapp_task, answer=None, **kwargs):
        """The trainer's own reward function (weight 0): what it sees of each row."""
        if answer is not None:
            seen.append(list(zip(answer, rayapp_task, strict=True)))
        return [0.0] * len(completions)

    rows = dataset_rows()
    train = Dataset.from_list(rows)
    try:
        source = Recorded(step_runner(backend, eval_copies=EVAL_COPIES))
        rollout_func = RayappRolloutFunc(source, prompts=TrainerPrompts("math", rows=train, fields=FIELDS))
        args = trl.GRPOConfig(output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=GROUPS * G,
                              num_generations=G, num_generations_eval=EVAL_COPIES, per_device_eval_batch_size=4,
                              reward_weights=[1.0, 0.0], learning_rate=1e-2, logging_steps=1, save_strategy="no",
                              eval_strategy="no", report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(SHIPPED),
                          processing_class=AutoTokenizer.from_pretrained(SHIPPED),
                          reward_funcs=[rayapp_reward, own_reward], args=args, rollout_func=rollout_func,
                          train_dataset=train, eval_dataset=Dataset.from_list(rayapp_eval_prompts(EVAL_PROMPTS)))
        trainer.train()
        evals = [trainer.evaluate(), trainer.evaluate()]
        yield {"source": source, "rollout_func": rollout_func, "batches": batches, "seen": seen, "rows": rows,
               "trainer": trainer, "evals": evals}
    finally:
        backend.shutdown()


def test_each_step_runs_the_trainers_prompts_in_order_with_their_rows_labels(trained):
    results = [r for r in trained["source"].results if isinstance(r, RolloutResult)]
    train_batches = trained["batches"][:STEPS]
    assert len(results) == STEPS and [r.rollout_id for r in results] == list(range(STEPS))
    assert trained["rollout_func"].asked == [(s, s) for s in range(STEPS)]
    for result, batch in zip(results, train_batches, strict=True):
        samples = [s for g in result.groups for s in g]
        assert len(samples) == len(batch) == GROUPS * G
        for s, row in zip(samples, batch, strict=True):  # row i of TRL's batch is a completion of its prompt
            assert s.prompt == row["prompt"] and s.label == row["answer"]
            assert s.metadata["question"] == row["question"]
        ids = [g[0].metadata["_group_id"] for g in result.groups]
        assert ids == [f"{result.rollout_id}/{i}" for i in range(GROUPS)]


def test_the_trainers_own_reward_functions_see_each_rows_answer_beside_its_rayapp_task(trained):
    rows = trained["rows"]
    assert len(trained["seen"]) == STEPS
    for step in trained["seen"]:
        assert len(step) == GROUPS * G
        for answer, task_id in step:  # trl-<i>: the dataset row the prompt was looked up in
            assert rows[int(task_id.rsplit("-", 1)[1])]["answer"] == answer


def test_trls_eval_loop_is_served_by_rayapps_eval_step_and_logs_its_metrics(trained):
    first, second = trained["evals"]
    evals = [r for r in trained["source"].results if isinstance(r, EvalResult)]
    # the evaluation at global step 2 is rayapp's eval step 2; the second evaluation is served that step again
    assert trained["rollout_func"].evaluated == [(STEPS, STEPS), (STEPS, STEPS)]
    assert [e.rollout_id for e in evals] == [STEPS, STEPS]
    assert trained["source"].runner.status()["steps_run"]["eval"] == 1
    assert sum(map(len, evals[0].samples.values())) == EVAL_PROMPTS * EVAL_COPIES
    want = evals[0].metrics["eval/math-read/accuracy"]
    assert first["eval_rayapp/math-read/accuracy"] == pytest.approx(want)
    assert first["eval_rayapp/math-read/pass@2"] == pytest.approx(evals[0].metrics["eval/math-read/pass@2"])
    assert math.isfinite(first["eval_loss"]) and first["eval_loss"] == pytest.approx(second["eval_loss"])
    # TRL's own reward mean over the eval rows is rayapp's score of them
    scores = [s.reward["score"] for s in evals[0].samples["math-read"] if s.status is not Status.ABORTED]
    assert first["eval_rewards/rayapp_reward/mean"] == pytest.approx(sum(scores) / len(scores))


# ---- without trl ------------------------------------------------------------------------------

def test_trainer_prompts_become_tasks_with_their_rows_columns():
    rows = dataset_rows(3)
    prompts = TrainerPrompts("math", rows=rows, fields=FIELDS)
    tasks = prompts.tasks([rows[2]["prompt"]] * 2 + [rows[0]["prompt"]] * 2, 2)
    assert [(t.task_id, t.label, t.config, t.metadata) for t in tasks] == [
        ("trl-2", rows[2]["answer"], TaskConfig("math", n_samples=2), {"question": rows[2]["question"]}),
        ("trl-0", rows[0]["answer"], TaskConfig("math", n_samples=2), {"question": rows[0]["question"]})]
    with pytest.raises(ValueError, match=r"TRL's prompts 0\.\.1 are not one prompt repeated num_generations=2"):
        prompts.tasks([rows[0]["prompt"], rows[1]["prompt"]], 2)
    with pytest.raises(ValueError, match=r"TRL's prompt 2 is in none of the trl rows"):
        prompts.tasks([rows[0]["prompt"]] * 2 + ["something else"] * 2, 2)
    with pytest.raises(ValueError, match="TRL handed 3 prompts, not a multiple of num_generations=2"):
        prompts.tasks([rows[0]["prompt"]] * 3, 2)
    bare = TrainerPrompts("arithmetic").tasks(["What is 2+2?"] * 3, 3)
    assert bare == [Task("trl-0", "What is 2+2?", TaskConfig("arithmetic", n_samples=3))]


def test_rows_that_share_a_prompt_must_agree_and_a_bad_row_is_named():
    rows = dataset_rows(2)
    TrainerPrompts("math", rows=[*rows, dict(rows[0])], fields=FIELDS)  # a repeated row is one task
    with pytest.raises(ValueError, match=r"trl rows\[0\] and rows\[2\] have the same prompt but other columns"):
        TrainerPrompts("math", rows=[*rows, {**rows[0], "answer": "-1"}], fields=FIELDS)
    with pytest.raises(ValueError, match=r"^trl rows\[1\]: \$\.answer: missing required field$"):
        TrainerPrompts("math", rows=[rows[0], {"prompt": "p"}], fields=FIELDS)


def eval_sample(task_id, copy, score):
    return Sample(task_id, copy, "p", tokens=[1, 2, 3], response_length=1, loss_mask=[1], rollout_log_probs=[-0.1],
                  status=Status.COMPLETED, reward={"score": score})


def eval_trainer(n_prompts, step=0, copies=2):
    args = NS(steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1)
    return NS(args=args, state=NS(global_step=step), accelerator=NS(num_processes=1), model=NS(training=False),
              num_generations=4, num_generations_eval=copies, processing_class=NS(pad_token_id=0), tools=None,
              eval_dataset=[None] * n_prompts)


class EvalSource:
    def __init__(self):
        self.asked = []

    def rollout(self, rollout_id, tasks=None):
        raise AssertionError("an eval batch runs no rollout step")

    def evaluate(self, rollout_id):
        self.asked.append(rollout_id)
        samples = {"a": [eval_sample("a0", 0, 1.0), eval_sample("a0", 1, 0.0)],
                   "b": [eval_sample("b0", 0, 1.0), eval_sample("b0", 1, 1.0), eval_sample("b1", 0, 0.0),
                         eval_sample("b1", 1, 0.0)]}
        return EvalResult(rollout_id, {"eval/a/accuracy": 0.5, "eval/b/accuracy": 0.5}, samples)


def test_eval_batches_hand_out_the_eval_step_in_order_with_its_metrics():
    source = EvalSource()
    func = RayappRolloutFunc(source)
    trainer = eval_trainer(3, step=5)
    first, second = func([None] * 4, trainer), func([None] * 2, trainer)
    assert first["rayapp_task"] == ["a0", "a0", "b0", "b0"] and second["rayapp_task"] == ["b1", "b1"]
    assert first["rayapp_score"] + second["rayapp_score"] == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    assert first[EVAL_FIELD] == {"rayapp/a/accuracy": 0.5, "rayapp/b/accuracy": 0.5}
    func([None] * 6, trainer)  # the next evaluation at the same step asks for the step again (rayapp serves it)
    assert source.asked == [5, 5] and func.evaluated == [(5, 5), (5, 5)]
    logged = []
    assert rayapp_reward(["c"] * 2, [1.0, 0.0], rayapp_eval=[first[EVAL_FIELD]] * 2,
                         log_metric=lambda k, v: logged.append((k, v))) == [1.0, 0.0]
    assert logged == [("rayapp/a/accuracy", 0.5), ("rayapp/b/accuracy", 0.5)]


def test_an_eval_dataset_of_another_size_or_copies_of_another_count_are_one_clear_error():
    with pytest.raises(ValueError, match=r"eval 0: TRL's eval dataset has 2 prompts and rayapp's eval step 3; make "
                                         r"it rayapp_eval_prompts\(3\)"):
        RayappRolloutFunc(EvalSource())([None] * 2, eval_trainer(2))
    with pytest.raises(ValueError, match=r"eval 0: eval set 'a' does not come in groups of num_generations_eval=3"):
        eval_rows(EvalSource().evaluate(0), 3)
    func = RayappRolloutFunc(EvalSource())
    func([None] * 4, eval_trainer(3))
    with pytest.raises(ValueError, match=r"TRL asked for rows 4\.\.7 of the eval step's 6"):
        func([None] * 4, eval_trainer(3))


def test_the_trainers_rows_for_a_rollout_must_come_back_as_its_tasks():
    rows = dataset_rows(1)

    class Wrong:
        def rollout(self, rollout_id, tasks=None):
            return RolloutResult(rollout_id, [[Sample("other", i, "p", tokens=[1, 2], response_length=1,
                                                      loss_mask=[1], rollout_log_probs=[-0.1], reward={"score": 1.0},
                                                      status=Status.COMPLETED) for i in range(2)]])

    trainer = eval_trainer(0)
    trainer.model, trainer.num_generations = NS(training=True), 2
    func = RayappRolloutFunc(Wrong(), prompts=TrainerPrompts("math", rows=rows, fields=FIELDS))
    with pytest.raises(ValueError, match=r"rollout 0: its groups are tasks \['other'\], not the trainer's \['trl-0'\]"):
        func([rows[0]["prompt"]] * 2, trainer)
