"""slime's rollout function (``rayapp.trainers.slime``) against the Serve app, as slime's
RolloutManager calls it (``call_rollout_fn``): the prompts of slime's own data source go to the
manager as the step's tasks through the handle, the checkpoint slime's ``--save-hf`` leaves after a
step reaches both engine replicas before the next one, and the eval after a step runs on that step's
weights. Skipped without slime (docs/trainers.md, slime); on the isolated files' shared Ray head (conftest.py)."""

import json
import shutil
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import yaml
from safetensors.torch import load_file, save_file
from shared_head import serve_app

from rayapp.cli import ROOT
from rayapp.envs.math import tool_result_rows


@pytest.fixture(scope="module")
def slime():
    """slime's pieces, or a skip: the test is collected either way (a module-level skip collects
    nothing, and pytest's exit 5 fails `make test`'s loop)."""
    pytest.importorskip("slime.utils.types", reason="slime is installed from its source: docs/trainers.md, slime")
    from slime.rollout import base_types, data_source

    from rayapp.trainers import slime as adapter
    return NS(types=base_types, data=data_source, adapter=adapter)


@pytest.fixture(scope="module")
def app(head, slime, tmp_path_factory, model_dir):
    import ray

    tmp = tmp_path_factory.mktemp("slime-serve")
    cfg = yaml.safe_load((ROOT / "recipes" / "train_grpo" / "rollout.yaml").read_text())
    args = cfg["applications"][0]["args"]
    args["data"]["math"] |= {"n_prompts": 8, "n_samples_per_prompt": 2}
    args["eval"] = {"math": args["eval"]["math"] | {"n_prompts": 2}}
    args["scheduler"]["rollout_batch_size"] = 2
    # where this test's "slime" saves, and the weights it starts from (loaded before step 0)
    args["engines"]["student"]["weight_roots"] = [str(tmp), str(model_dir)]
    with serve_app(head, cfg, tmp):
        ray.init(address=head.address, namespace="rayapp-slime", logging_level="error", log_to_driver=False)
        try:
            yield tmp
        finally:
            ray.shutdown()


def slime_args(tmp: Path, model_dir: Path) -> Namespace:
    rows = tool_result_rows(NS(n_prompts=6, seed=11))
    data = tmp / "prompts.jsonl"
    data.write_text("".join(json.dumps({"messages": t.prompt, "label": t.label}) + "\n" for t in rows))
    return Namespace(rollout_batch_size=2, n_samples_per_prompt=2, reward_key=None, eval_reward_key=None,
                     rollout_global_dataset=True, prompt_data=str(data), hf_checkpoint=str(model_dir),
                     rollout_max_prompt_len=None, input_key="messages", multimodal_keys=None, label_key="label",
                     metadata_key="metadata", tool_key=None, apply_chat_template=False,
                     apply_chat_template_kwargs=None, rollout_seed=42, rollout_shuffle=False, dump_details=None,
                     buffer_filter_path=None, save_hf=str(tmp / "hf" / "iter_{rollout_id}"), save_interval=1,
                     rayapp_app="rayapp", rayapp_timeout_s=600, rayapp_prompts="slime", rayapp_task_type="math")


def train_step(args: Namespace, model_dir: Path, rollout_id: int) -> None:
    """What slime leaves after training step ``rollout_id``: an HF checkpoint at --save-hf."""
    path = Path(args.save_hf.format(rollout_id=rollout_id))
    shutil.copytree(model_dir, path)
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v + 0.001 if v.is_floating_point() else v for k, v in weights.items()}, path / "model.safetensors")


def test_slimes_prompts_and_weights_go_through_the_serve_app(slime, app, model_dir):
    call_rollout_fn, generate_rollout = slime.types.call_rollout_fn, slime.adapter.generate_rollout
    args = slime_args(app, model_dir)
    data_source = slime.data.RolloutDataSourceWithBuffer(args)
    steps = []
    for rollout_id in range(2):
        out = call_rollout_fn(generate_rollout, args, rollout_id, data_source, evaluation=False)
        assert isinstance(out, slime.types.RolloutFnTrainOutput)
        steps.append([s for g in out.samples for s in g])
        train_step(args, model_dir, rollout_id)
    for rollout_id, samples in enumerate(steps):
        assert [s.group_index for s in samples] == [2 * rollout_id + k // 2 for k in range(4)]
        assert [s.index for s in samples] == list(range(4 * rollout_id, 4 * rollout_id + 4))
        assert all(s.response_length == len(s.loss_mask) == len(s.rollout_log_probs) > 0 for s in samples)
        # every model turn of step N ran on the weights slime saved after step N-1 (step 0: on those it
        # starts from, --hf-checkpoint, version 1), on either replica
        assert {v for s in samples for v in s.weight_versions} == {str(rollout_id + 1)}
    assert slime.adapter.source_of(args).loaded == args.save_hf.format(rollout_id=0)

    out = call_rollout_fn(generate_rollout, args, 1, data_source, evaluation=True)  # after training step 1
    assert isinstance(out, slime.types.RolloutFnEvalOutput) and list(out.data) == ["math"]
    samples = out.data["math"]["samples"]
    assert len(samples) == len(out.data["math"]["rewards"]) > 0
    assert {v for s in samples for v in s.weight_versions} == {"3"}
