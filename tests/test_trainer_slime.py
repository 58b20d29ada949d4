"""slime (THUDM/slime v0.3.1, commit a6272da0) takes its rollouts from rayapp through
``rayapp.trainers.slime``: checked against slime's own code, installed without its dependencies
(docs/trainers.md says how; the test is skipped where ``slime.utils.types`` does not import).

- The contract: slime's RolloutManager calls the rollout function through ``call_rollout_fn`` with
  ``(args, rollout_id, data_source)`` and ``evaluation=``, read from slime's ``slime/ray/rollout.py``;
  the adapter's signature takes that call, and every field it sets is a field of slime's ``Sample``.
- The driver: slime's RolloutManager itself cannot be imported here (its module imports SGLang), so
  its methods that take the rollout function's output (``_get_rollout_data``,
  ``_post_process_rewards``, ``_convert_samples_to_train_data``, and the check
  ``_validate_rollout_id_annotated``) are compiled from that file as they are and run on a stand-in
  ``self``, with slime's real ``call_rollout_fn``, data source, ``Sample`` and data-parallel
  schedule. The rollouts come from an in-process StepRunner on the tiny model (the hf engine, the
  local recipe's math-read data); a "training step" between rollouts writes a checkpoint where
  slime's ``--save-hf`` would, and the engine loads it before the next step.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
import json
import logging
import shutil
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace as NS

import msgspec
import pytest
import torch
from agent_helpers import InProcessEngine
from safetensors.torch import load_file, save_file

pytest.importorskip("slime.utils.types", reason="slime is installed from its source: docs/trainers.md, slime")

from slime.rollout.base_types import RolloutFnEvalOutput, call_rollout_fn
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.utils.data import get_source
from slime.utils.dp_schedule import build_dp_schedule
from slime.utils.types import Sample as SlimeSample

from rayapp.cli import ROOT
from rayapp.core.contracts import RolloutResult
from rayapp.envs.math import tool_result_rows
from rayapp.inference.hf import HFBackend
from rayapp.inference.tiny_model import SHIPPED
from rayapp.recipe import build_step_runner, load_recipe
from rayapp.trainers.converters import to_slime
from rayapp.trainers.slime import generate_rollout
from rayapp.trainers.sync import call as sync_call
from rayapp.types import Sample, Status

GROUPS, N = 2, 2
MANAGER = Path(importlib.util.find_spec("slime").submodule_search_locations[0]) / "ray" / "rollout.py"
TAKEN = ("_get_rollout_data", "_post_process_rewards", "_convert_samples_to_train_data")


def manager_code() -> dict:
    """RolloutManager's methods in ``TAKEN`` and ``_validate_rollout_id_annotated``, compiled from
    slime's file (read, not imported: see the module docstring), in a namespace of slime's names."""
    tree = ast.parse(MANAGER.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_validate_rollout_id_annotated"]
    manager = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "RolloutManager")
    nodes += [n for n in manager.body if isinstance(n, ast.FunctionDef) and n.name in TAKEN]
    assert sorted(n.name for n in nodes) == sorted((*TAKEN, "_validate_rollout_id_annotated"))
    space = {"torch": torch, "itertools": itertools, "Sample": SlimeSample, "get_source": get_source,
             "call_rollout_fn": call_rollout_fn, "logger": logging.getLogger("slime")}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(MANAGER), "exec"), space)
    return space


class Manager:
    """A stand-in ``self`` for slime's RolloutManager methods, holding what they read."""

    def __init__(self, args):
        code = manager_code()
        self.args, self.data_source = args, RolloutDataSourceWithBuffer(args)
        self.generate_rollout = self.eval_generate_rollout = generate_rollout
        self.custom_reward_post_process_func = self.custom_convert_samples_to_train_data_func = None
        for name in TAKEN:
            setattr(self, name, code[name].__get__(self))

    def eval(self, rollout_id):  # what RolloutManager.eval does before it logs
        return call_rollout_fn(self.eval_generate_rollout, self.args, rollout_id, self.data_source, evaluation=True)


def slime_args(tmp: Path, source) -> Namespace:
    """slime's settings the manager's methods read (their defaults, the rest named), and the adapter's."""
    return Namespace(rollout_batch_size=GROUPS, n_samples_per_prompt=N, global_batch_size=GROUPS * N,
                     reward_key=None, eval_reward_key=None, advantage_estimator="grpo", rewards_normalization=True,
                     grpo_std_normalization=True, load_debug_rollout_data=None, rollout_global_dataset=False,
                     prompt_data=None, buffer_filter_path=None, rollout_top_p=1.0, micro_batch_size=1,
                     use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False, balance_by_flops=False,
                     save_hf=str(tmp / "hf" / "iter_{rollout_id}"), save_interval=1, hf_checkpoint=str(SHIPPED),
                     rayapp_source=source)


class InProcess:
    """The manager's three calls over a StepRunner and its engine in this process."""

    def __init__(self, runner, backend):
        self.runner, self.backend, self.asked = runner, backend, []

    async def rollout(self, rollout_id, tasks=None):
        self.asked.append(("rollout", rollout_id) if tasks is None else ("rollout", rollout_id, tasks))
        return await self.runner.rollout(rollout_id, tasks)

    async def evaluate(self, rollout_id):
        self.asked.append(("eval", rollout_id))
        return await self.runner.evaluate(rollout_id)

    async def update_weights(self, path):
        self.asked.append(("weights", path))
        return await self.backend.update_weights_from_disk(path)


class Counting(InProcessEngine):
    """The engine, counting the turns it generated."""

    turns = 0

    async def generate(self, req, timeout_s=None):
        self.turns += 1
        return await super().generate(req, timeout_s)


def step_runner(backend, engine=None):
    cfg = load_recipe(ROOT / "recipes" / "local" / "rollout.yaml")[1]
    data = {"math-read": msgspec.structs.replace(cfg.data["math-read"], n_samples_per_prompt=N)}
    evals = {"math-read": msgspec.structs.replace(cfg.eval["math-read"], n_prompts=2)}
    scheduler = msgspec.structs.replace(cfg.scheduler, rollout_batch_size=GROUPS, save_eval_details=None)
    cfg = msgspec.structs.replace(cfg, data=data, eval=evals, scheduler=scheduler)

    async def inline(token, fn, *args):
        return fn(*args)

    async def no_sandbox(*args, **kwargs):
        raise AssertionError("math opens no sandbox")

    return build_step_runner(cfg, {"student": engine or InProcessEngine(backend)}, None, executor=inline,
                             open_sandbox=no_sandbox)


def train_step(args, rollout_id: int) -> dict:
    """What slime's trainer leaves after training step ``rollout_id``: an HF checkpoint at --save-hf."""
    path = Path(args.save_hf.format(rollout_id=rollout_id))
    shutil.copytree(SHIPPED, path)
    weights = load_file(SHIPPED / "model.safetensors")
    moved = {k: v + 0.01 * (rollout_id + 1) if v.is_floating_point() else v for k, v in weights.items()}
    save_file(moved, path / "model.safetensors")
    return moved


@pytest.fixture(scope="module")
def driven(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slime")
    backend = HFBackend(str(SHIPPED), max_concurrency=4, seed=0)
    try:
        # an earlier run's final weights, left in the engine: slime's step 0 must not run on them
        earlier = tmp / "earlier-run"
        shutil.copytree(SHIPPED, earlier)
        save_file({k: v + 0.5 if v.is_floating_point() else v for k, v in load_file(SHIPPED / "model.safetensors")
                   .items()}, earlier / "model.safetensors")
        sync_call(backend.update_weights_from_disk, (str(earlier),), 600, "the earlier run's weights")
        source = InProcess(step_runner(backend), backend)
        manager = Manager(slime_args(tmp, source))
        out = {"source": source, "manager": manager, "backend": backend, "steps": []}
        out["eval_before"] = manager.eval(0)
        for rollout_id in range(2):
            samples, metrics = manager._get_rollout_data(rollout_id)  # slime's own path from the function
            train = manager._convert_samples_to_train_data(samples)
            out["steps"].append({"samples": samples, "train": train, "metrics": metrics,
                                 "version": backend.info()["weight_version"]})
            out.setdefault("weights", []).append(train_step(manager.args, rollout_id))
        out["again"] = manager._get_rollout_data(1)[0]
        out["eval_after"] = manager.eval(1)
        out["version_after"] = backend.info()["weight_version"]
        yield out
    finally:
        backend.shutdown()


def test_the_function_takes_slimes_call_and_returns_its_output_types():
    tree = ast.parse(MANAGER.read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "call_rollout_fn"]
    shapes = {(ast.unparse(c.args[0]), tuple(ast.unparse(a) for a in c.args[1:]),
               tuple((k.arg, ast.unparse(k.value)) for k in c.keywords)) for c in calls}
    assert shapes == {
        ("self.generate_rollout", ("self.args", "rollout_id", "self.data_source"), (("evaluation", "False"),)),
        ("self.eval_generate_rollout", ("self.args", "rollout_id", "self.data_source"), (("evaluation", "True"),)),
    }
    inspect.signature(generate_rollout).bind(Namespace(), 0, None, evaluation=True)
    assert list(inspect.signature(generate_rollout).parameters) == ["args", "rollout_id", "data_source", "evaluation"]


def test_every_field_the_adapter_sets_is_a_field_of_slimes_sample():
    # Sample.from_dict keeps an unknown key as a plain attribute: a misspelt field would pass unseen
    sample = Sample("t", 0, "p", status=Status.COMPLETED, tokens=[1, 2], response_length=1, loss_mask=[1],
                    rollout_log_probs=[-0.1], reward={"score": 1.0})
    keys = set(to_slime(RolloutResult(0, [[sample]]))[0])
    assert keys <= set(SlimeSample.__dataclass_fields__), keys - set(SlimeSample.__dataclass_fields__)
    assert {s.value for s in Status} <= {s.value for s in SlimeSample.Status}


def test_slimes_manager_turns_the_rollouts_into_train_data_of_rayapps_tokens(driven):
    for rollout_id, step in enumerate(driven["steps"]):
        samples, train = step["samples"], step["train"]
        assert len(samples) == GROUPS * N and all(isinstance(s, SlimeSample) for s in samples)
        assert step["metrics"] and all(isinstance(v, float) for v in step["metrics"].values())  # rayapp's, logged
        assert [s.group_index for s in samples] == [rollout_id * GROUPS + k // N for k in range(GROUPS * N)]
        assert [s.index for s in samples] == list(range(rollout_id * GROUPS * N, (rollout_id + 1) * GROUPS * N))
        for s in samples:
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length > 0
            assert all(lp <= 0 for lp in s.rollout_log_probs) and s.status == SlimeSample.Status.COMPLETED
        assert train["tokens"] == [s.tokens for s in samples]
        assert train["loss_masks"] == [s.loss_mask for s in samples]
        assert train["rollout_log_probs"] == [s.rollout_log_probs for s in samples]
        assert train["raw_reward"] == [s.reward for s in samples] and all(r in (0.0, 1.0) for r in train["raw_reward"])
        # slime's GRPO normalisation: each group of N against its own mean
        raw = torch.tensor(train["raw_reward"]).view(GROUPS, N)
        centred = raw - raw.mean(dim=1, keepdim=True)
        assert torch.allclose(torch.tensor(train["rewards"]).view(GROUPS, N),
                              centred / (centred.std(dim=1, keepdim=True) + 1e-6))
        # every sample lands in slime's data-parallel schedule (a step of global_batch_size rollouts)
        parts, _, _, sizes = build_dp_schedule(driven["manager"].args, {"dp_size": 1, "cp_size": 1, "vpp_size": 1,
                                               "microbatch_group_size_per_vp_stage": 1},
                                               [len(t) for t in train["tokens"]], global_batch_size=GROUPS * N,
                                               rollout_indices=train["rollout_ids"])
        assert sorted(parts[0]) == list(range(GROUPS * N)) and sizes == [GROUPS * N]


def test_each_step_runs_on_the_weights_slime_saved_after_the_one_before(driven):
    steps, source = driven["steps"], driven["source"]
    assert [s["version"] for s in steps] == [2, 3]  # 1: the earlier run's; 2: the weights slime starts from
    for rollout_id, step in enumerate(steps):
        assert {v for s in step["samples"] for v in s.weight_versions} == {str(rollout_id + 2)}
    served = driven["backend"].model.state_dict()
    last = driven["weights"][1]
    assert all(torch.equal(served[k], last[k]) for k in last)  # the eval after step 1 ran on step 1's weights
    save_hf = driven["manager"].args.save_hf
    assert source.asked == [("weights", str(SHIPPED)), ("eval", 0), ("rollout", 0),
                            ("weights", save_hf.format(rollout_id=0)), ("rollout", 1), ("rollout", 1),
                            ("weights", save_hf.format(rollout_id=1)), ("eval", 2)]


def test_a_step_asked_again_is_the_same_step(driven):
    first, again = driven["steps"][1]["samples"], driven["again"]
    assert [s.to_dict() for s in again] == [s.to_dict() for s in first]


def test_eval_output_is_what_slimes_eval_logging_reads(driven):
    for out in (driven["eval_before"], driven["eval_after"]):
        assert isinstance(out, RolloutFnEvalOutput) and list(out.data) == ["math-read"]
        data = out.data["math-read"]
        assert len(data["rewards"]) == len(data["truncated"]) == len(data["samples"]) > 0
        assert data["rewards"] == [s.reward for s in data["samples"]]
        assert [s.index for s in data["samples"]] == list(range(len(data["samples"])))
    assert driven["version_after"] == 4  # the earlier run's, the start's, then slime's two checkpoints
    before = {v for s in driven["eval_before"].data["math-read"]["samples"] for v in s.weight_versions}
    assert before == {"2"}  # the eval before training, on the weights slime starts from


@pytest.fixture(scope="module")
def chosen(tmp_path_factory):
    """slime's own data source (``RolloutDataSourceWithBuffer`` over a JSONL file of math-read
    prompts, as ``--prompt-data`` reads it) chooses the prompts: ``rayapp_prompts: slime``."""
    tmp = tmp_path_factory.mktemp("slime-prompts")
    rows = tool_result_rows(NS(n_prompts=6, seed=7))
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": t.prompt, "label": t.label, "metadata": t.metadata}) + "\n"
                            for t in rows))
    backend = HFBackend(str(SHIPPED), max_concurrency=4, seed=0)
    engine = Counting(backend)

    def manager():
        args = slime_args(tmp, source)
        vars(args).update(rollout_global_dataset=True, prompt_data=str(data), hf_checkpoint=str(SHIPPED),
                          rollout_max_prompt_len=None, input_key="messages", multimodal_keys=None,
                          label_key="label", metadata_key="metadata", tool_key=None, apply_chat_template=False,
                          apply_chat_template_kwargs=None, rollout_seed=42, rollout_shuffle=False,
                          dump_details=None, rayapp_prompts="slime", rayapp_task_type="math",
                          rayapp_sync_weights=False)
        return Manager(args)

    try:
        source = InProcess(step_runner(backend, engine), backend)
        first = manager()
        out = {"rows": rows, "source": source, "first": first, "steps": [first._get_rollout_data(i)[0] for i in (0, 1)]}
        out["turns"] = engine.turns
        out["resumed"] = manager()._get_rollout_data(0)[0]  # a restarted run: its data source back at the start
        out["turns_resumed"] = engine.turns
        yield out
    finally:
        backend.shutdown()


def test_slimes_data_source_chooses_the_prompts_and_the_ids(chosen):
    rows, asked = chosen["rows"], chosen["source"].asked
    for step, samples in enumerate(chosen["steps"]):
        assert [s.group_index for s in samples] == [2 * step + k // N for k in range(GROUPS * N)]
        assert [s.index for s in samples] == list(range(GROUPS * N * step, GROUPS * N * (step + 1)))
        for s in samples:
            row = rows[s.group_index]
            assert (s.prompt, s.label) == (row.prompt, row.label)
            assert s.metadata["question"] == row.metadata["question"]
            assert s.response_length > 0 and s.reward in (0.0, 1.0)
        tasks = asked[step][2]
        assert [t["task_id"] for t in tasks] == [f"slime-{2 * step + g}" for g in range(GROUPS)]
        assert all(t["config"] == {"task_type": "math", "n_samples": N} for t in tasks)


def test_a_resumed_run_gets_the_stored_step_and_other_prompts_are_refused(chosen):
    assert [s.to_dict() for s in chosen["resumed"]] == [s.to_dict() for s in chosen["steps"][0]]
    assert chosen["turns_resumed"] == chosen["turns"]  # served, not run again
    # the first run's data source has moved on: its next prompts are not step 0's
    with pytest.raises(ValueError, match=r"rollout 0 .*trainer-chosen tasks .* a step's tasks cannot change"):
        chosen["first"]._get_rollout_data(0)
