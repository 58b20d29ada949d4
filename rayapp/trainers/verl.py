"""verl's ``RayPPOTrainer.fit()`` (verl==0.9.1) taking its rollouts from rayapp (docs/trainers.md, verl).

It exists so a verl user keeps the dataloader and trainer and swaps only the rollout: two dotted
paths in the trainer's config, ``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` =
``rayapp.trainers.verl.RayappAgentLoopManager`` and ``...rollout.checkpoint_manager_class`` =
``rayapp.trainers.verl.RayappCheckpointManager``, plus an optional ``rayapp`` section
(``VerlSettings``). Only verl's legacy trainer (``trainer.use_v1=False``) is served: the v1 trainer
passes rollouts on through a TransferQueue this adapter does not write, so ``use_v1`` is refused.
Invariant: group i of the step fills rows i*n..i*n+n-1 and carries their ``uid``, so GRPO groups
exactly rayapp's groups. Prompts, rewards, log-probs, step ids and weights: docs/trainers.md, verl.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import numpy as np
from verl import DataProto

from rayapp.core.contracts import RolloutResult
from rayapp.core.convert import convert
from rayapp.envs.datasets.files import FieldMap
from rayapp.trainers.converters import EpisodeKey, verl_tensors
from rayapp.trainers.step_tasks import tasks_from_rows
from rayapp.trainers.sync import ServeManager, call
from rayapp.types import Sample, Status, Task, TaskKey


class VerlSettings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The ``rayapp`` section of verl's config."""

    app: str = "rayapp"  # the Serve application's name
    engine: str = "student"  # the engine the actor's weights go to
    task_type: str | None = None  # the evaluator every row goes to; None: each row's data_source
    first_rollout_id: Annotated[int, msgspec.Meta(ge=0)] = 0
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    weights_dir: str | None = None  # where weights are saved for the engines; None: trainer.default_local_dir
    pad_token_id: int = 0


def settings(config: Any) -> VerlSettings:
    from omegaconf import OmegaConf

    section = config.get("rayapp") if hasattr(config, "get") else None
    raw = OmegaConf.to_container(section, resolve=True) if section is not None else {}
    return convert(raw, VerlSettings, "verl config", root="$.rayapp")


def _plain(value: Any) -> Any:
    """A non-tensor cell as plain data (verl's collate leaves numpy arrays and scalars in them)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def group_uids(batch: DataProto, what: str) -> tuple[list[str], int]:
    """The batch's uids, one per prompt, and n: fit() repeats each prompt n times in a row."""
    uids = batch.non_tensor_batch.get("uid")
    if uids is None or len(uids) == 0:
        raise ValueError(f"{what}: the generation batch has no 'uid' (fit() adds one per prompt)")
    runs: list[list[Any]] = []
    for u in uids:
        if runs and runs[-1][0] == u:
            runs[-1][1] += 1
        else:
            runs.append([u, 1])
    sizes = {size for _, size in runs}
    if len(sizes) != 1 or len({u for u, _ in runs}) != len(runs):
        raise ValueError(f"{what}: uids are not runs of one size (fit()'s repeat(n, interleave=True)): "
                         f"run sizes {sorted(sizes)}, {len(runs)} runs of {len({u for u, _ in runs})} uids")
    return [str(u) for u, _ in runs], sizes.pop()


def verl_tasks(batch: DataProto, n: int, task_type: str | None, what: str) -> list[Task]:
    """One Task per prompt of the generation batch (module docstring)."""
    cells = batch.non_tensor_batch
    if "raw_prompt" not in cells:
        raise ValueError(f"{what}: the generation batch has no 'raw_prompt' (verl's RLHFDataset gives the chat "
                         f"messages there); it has {sorted(cells)}")
    if task_type is None and "data_source" not in cells:
        raise ValueError(f"{what}: rows name no data_source; set rayapp.task_type in verl's config")
    rows = []
    for i in range(0, len(batch), n):
        reward_model = _plain(cells["reward_model"][i]) if "reward_model" in cells else {}
        row = {"prompt": _plain(cells["raw_prompt"][i]),
               "label": reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
               "task_id": str(_plain(cells["index"][i])) if "index" in cells else f"verl-{i // n}"}
        if "data_source" in cells:
            row["data_source"] = str(_plain(cells["data_source"][i]))
        rows.append(row)
    # the row's data_source is its task type, or else kept in its metadata (one column fills one field)
    fields = FieldMap(prompt="prompt", label="label", task_id="task_id",
                      task_type=None if task_type else "data_source",
                      metadata=["data_source"] if task_type and "data_source" in cells else [])
    return tasks_from_rows(rows, task_type=task_type or "unset", n_samples=n, fields=fields, name=what)


def _group_index(group: list[Sample], rollout_id: int) -> int:
    name = str(group[0].metadata.get(TaskKey.GROUP_ID.value, "")) if group else ""
    head, _, index = name.rpartition("/")
    if head != str(rollout_id) or not index.isdigit():
        raise ValueError(f"rollout {rollout_id}: a group names no task of this step ({TaskKey.GROUP_ID.value} "
                         f"{name!r}); was it run with the trainer's tasks?")
    return int(index)


def fit_batch(result: RolloutResult, uids: list[str], n: int, *, pad_token_id: int = 0,
              prompt_length: int | None = None, response_length: int | None = None) -> DataProto:
    """``result`` as the generation output fit() takes: row i*n+j is sample j of the group of task i,
    with ``uids[i]`` (module docstring)."""
    groups: dict[int, list[Sample]] = {}
    for group in result.groups:
        groups[_group_index(group, result.rollout_id)] = group
    sizes = [len(groups.get(i, [])) for i in range(len(uids))]
    if set(groups) != set(range(len(uids))) or any(s != n for s in sizes):
        raise ValueError(f"rollout {result.rollout_id}: groups of {sizes} samples for {len(uids)} prompts, but fit() "
                         f"joins n={n} rows per prompt; turn the recipe's survivorship filters off")
    # an aborted sample stays in its row (fit() needs every row), out of the loss: verl_tensors masks
    # a removed sample's tokens all 0
    ordered = [[msgspec.structs.replace(s, remove_sample=True) if s.status is Status.ABORTED else s
                for s in groups[i]] for i in range(len(uids))]
    parts = verl_tensors(RolloutResult(result.rollout_id, ordered), pad_token_id=pad_token_id,
                         prompt_length=prompt_length, response_length=response_length)
    tensors, cells = parts["tensors"], parts["non_tensors"]
    tensors["rm_scores"] = tensors.pop("token_level_scores")  # what fit()'s extract_reward reads
    samples = [s for g in ordered for s in g]
    non_tensors = {
        "uid": np.array([u for u in uids for _ in range(n)], dtype=object),
        # rayapp's own, named apart from the dataset's columns (fit()'s union keeps both)
        "rayapp_task_id": cells["task_id"], "rayapp_sample_index": cells["index"], "rayapp_status": cells["status"],
        "__num_turns__": np.array([int(s.metadata.get(EpisodeKey.TURNS) or 0) for s in samples], dtype=np.int32),
        "score": tensors["rm_scores"].sum(dim=-1).numpy(),
        # fit() reads it on every row (text only here: no images)
        "multi_modal_inputs": np.array([{} for _ in samples], dtype=object),
    }
    meta = {"rollout_id": result.rollout_id, "reward_extra_keys": ["score"]}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


_ACTIVE: list[RayappAgentLoopManager] = []  # the one fit()'s init_workers built (RayappCheckpointManager)


class RayappAgentLoopManager:
    """fit()'s ``async_rollout_manager``: ``generate_sequences`` is rayapp's rollout step for the
    trainer's step and prompts. ``source``: anything with ``rollout(rollout_id, tasks)`` and
    ``update_weights(path)``, sync or async; by default the Serve app's manager (``VerlSettings.app``).
    ``asked`` records (global_steps, rollout_id) per call."""

    def __init__(self, config: Any, llm_client: Any = None, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None, *, source: Any = None):
        self.config, self.settings = config, settings(config)
        trainer = config.get("trainer") if hasattr(config, "get") else None
        if trainer is not None and trainer.get("use_v1"):
            raise ValueError("rayapp.trainers.verl drives verl's RayPPOTrainer.fit(): set trainer.use_v1=False (verl "
                             "0.9.1's v1 trainer, its default, takes rollouts through its TransferQueue, which the "
                             "adapter does not write)")
        rollout = config.actor_rollout_ref.rollout
        self.prompt_length, self.response_length = int(rollout.prompt_length), int(rollout.response_length)
        if source is None:
            from rayapp.connection import manager_handle  # waits for the manager, bounded like a call

            source = ServeManager(manager_handle(self.settings.app, self.settings.timeout_s),
                                  engine=self.settings.engine, timeout_s=self.settings.timeout_s)
        self.source = source
        self.asked: list[tuple[int, int]] = []
        _ACTIVE[:] = [self]

    @classmethod
    def create(cls, *args: Any, **kwargs: Any) -> RayappAgentLoopManager:
        """How fit()'s init_workers builds its rollout manager (``AgentLoopManager.create``)."""
        return cls(*args, **kwargs)

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        step = int(prompts.meta_info.get("global_steps", 0))
        if prompts.meta_info.get("validate"):
            raise ValueError("rayapp: fit()'s validation does not run through rayapp; set trainer.val_before_train="
                             "False and trainer.test_freq=-1, and run rayapp's eval steps (manager.evaluate)")
        if "__do_sample__" in prompts.non_tensor_batch:
            raise ValueError("rayapp: REMAX's greedy baseline rows are not served by rayapp; use grpo (or another "
                             "estimator without a baseline rollout)")
        if step < 1:
            raise ValueError(f"rayapp: the generation batch's global_steps is {step}; fit() counts from 1")
        rollout_id = self.settings.first_rollout_id + step - 1
        what = f"rollout {rollout_id} (verl step {step})"
        uids, n = group_uids(prompts, what)
        tasks = verl_tasks(prompts, n, self.settings.task_type, what)
        self.asked.append((step, rollout_id))
        started = time.monotonic()
        result = call(self.source.rollout, (rollout_id, tasks), self.settings.timeout_s, what)
        out = fit_batch(result, uids, n, pad_token_id=self.settings.pad_token_id, prompt_length=self.prompt_length,
                        response_length=self.response_length)
        out.meta_info["timing"] = {"rayapp_rollout": time.monotonic() - started}  # fit() logs it as timing_s/
        return out


class RayappCheckpointManager:
    """fit()'s ``checkpoint_manager``: ``update_weights(global_steps)`` saves the actor's weights in
    Hugging Face form (``actor_wg.save_checkpoint``: ``hf_model`` must be in the actor's
    ``checkpoint.save_contents``) and has rayapp's engines load them (the source's
    ``update_weights``); the folder before it is removed once the engines answered. verl builds it
    with the checkpoint engine's config alone, so its settings are those of the
    ``RayappAgentLoopManager`` that init_workers built just before it. ``synced`` records
    (global_steps, path)."""

    def __init__(self, config: Any = None, actor_wg: Any = None, replicas: list | None = None):
        if not _ACTIVE:
            raise ValueError("RayappCheckpointManager needs actor_rollout_ref.rollout.agent.agent_loop_manager_class="
                             "rayapp.trainers.verl.RayappAgentLoopManager")
        self.rollouts, self.actor_wg, self.replicas = _ACTIVE[0], actor_wg, list(replicas or [])
        s, cfg = self.rollouts.settings, self.rollouts.config
        self.folder = Path(s.weights_dir or Path(cfg.trainer.default_local_dir) / "rayapp_weights")
        self.synced: list[tuple[int, str]] = []
        self._asleep = False

    def sleep_replicas(self) -> None:
        """verl's own replicas serve nothing here: asleep (weights and KV cache freed) once, for good."""
        if self._asleep or not self.replicas:
            return

        async def sleep_all() -> None:
            await asyncio.gather(*[r.sleep() for r in self.replicas])
        call(sleep_all, (), self.rollouts.settings.timeout_s, "putting verl's rollout replicas to sleep")
        self._asleep = True

    def update_weights(self, global_steps: int | None = None) -> None:
        step = int(global_steps or 0)
        path = self.folder / f"global_step_{step}"
        # None: verl's own checkpoint rotation (max_actor_ckpt_to_keep) never counts these folders
        self.actor_wg.save_checkpoint(str(path), None, step, max_ckpt_to_keep=None)
        hf = path / "huggingface"
        if not (hf / "config.json").is_file():
            raise ValueError(f"rayapp: the actor saved no Hugging Face model at {hf}: add 'hf_model' to "
                             "actor_rollout_ref.actor.checkpoint.save_contents (the driver, the actor's rank 0 and "
                             "rayapp's engines must see one filesystem there)")
        s = self.rollouts.settings
        replies = call(self.rollouts.source.update_weights, (str(hf),), s.timeout_s, f"weight update to {hf}")
        replies = replies if isinstance(replies, list) else [replies]  # a replica each, or one engine in process
        failed = [r for r in replies if isinstance(r, dict) and not r.get("ok", True)]
        if failed:
            raise RuntimeError(f"verl step {step}: weight update to {hf} failed on {failed}")
        if self.synced and Path(self.synced[-1][1]).parent != path:
            shutil.rmtree(Path(self.synced[-1][1]).parent, ignore_errors=True)
        self.synced.append((step, str(hf)))
