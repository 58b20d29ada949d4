"""TRL's ``GRPOTrainer`` (trl==1.16.0) taking its rollouts from rayapp (docs/trainers.md, TRL).

It exists so a TRL user trains on rayapp's rollouts with one change:
``GRPOTrainer(..., rollout_func=RayappRolloutFunc(source), reward_funcs=[rayapp_reward],
callbacks=[WeightSyncCallback(update, folder)])``. ``source`` is anything with
``rollout(rollout_id, tasks=None)`` (and ``evaluate(rollout_id)`` for TRL's eval loop), sync or
async: an in-process ``StepRunner`` or the Serve manager through ``ServeManager``. Invariant: every
group holds ``num_generations`` samples and ``prompt_ids`` are the tokens rayapp's episodes really
started from; a step that breaks the shape is one ValueError naming it. Prompts, eval, rewards,
masks, log-probs, step ids and weights: docs/trainers.md, TRL.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from transformers import TrainerCallback

from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.trainers.sync import ServeManager  # noqa: F401  (the TRL page names it here)
from rayapp.trainers.sync import call as _call
from rayapp.trainers.trl_tasks import TrainerPrompts
from rayapp.types import Sample, Status

SCORE_FIELD = "rayapp_score"
TASK_FIELD = "rayapp_task"  # each row's rayapp task id
EVAL_FIELD = "rayapp_eval"  # the eval step's metrics, on every row of an eval batch


def steps_per_rollout(trainer: Any) -> int:
    """How many optimizer steps one generation feeds: TRL generates every ``steps_per_generation *
    num_iterations`` micro-steps, ``gradient_accumulation_steps`` to an optimizer step."""
    args = trainer.args
    micro = args.steps_per_generation * args.num_iterations
    if micro % args.gradient_accumulation_steps:
        raise ValueError(f"GRPOConfig: steps_per_generation * num_iterations ({micro}) must be a multiple of "
                         f"gradient_accumulation_steps ({args.gradient_accumulation_steps}) for rayapp's rollout "
                         "ids to follow the trainer's steps (one rollout feeds one or more whole optimizer steps)")
    return micro // args.gradient_accumulation_steps


def _completion(sample: Sample, where: str,
                pad_id: int) -> tuple[list[int], list[int], list[float], list[int], float | None]:
    """One sample as (prompt ids, completion ids, log-probs, env mask, score)."""
    n = sample.response_length
    if not 0 <= n <= len(sample.tokens):
        raise ValueError(f"{where}: response_length {n} outside its {len(sample.tokens)} tokens")
    split = len(sample.tokens) - n
    prompt, completion = list(sample.tokens[:split]), list(sample.tokens[split:])
    if n == 0 or sample.remove_sample or sample.status is Status.ABORTED:
        # nothing the trainer may learn from, but its group keeps num_generations rows: fully masked
        # (TRL rejects an empty completion: one pad token then) and unscored (TRL: advantage 0)
        completion = completion or [pad_id]
        return prompt, completion, [0.0] * len(completion), [0] * len(completion), None
    if not len(sample.loss_mask) == len(sample.rollout_log_probs) == n:
        raise ValueError(f"{where}: response_length {n}, {len(sample.loss_mask)} loss_mask entries and "
                         f"{len(sample.rollout_log_probs)} log-probs do not match")
    if "score" not in sample.reward:
        raise ValueError(f"{where}: no reward['score'] (rewards {sorted(sample.reward)})")
    return prompt, completion, list(sample.rollout_log_probs), list(sample.loss_mask), float(sample.reward["score"])


def to_trl(result: RolloutResult, num_generations: int, n_prompts: int, pad_id: int = 0) -> dict[str, list]:
    """A rollout step as ``rollout_func``'s output: one row per sample, groups in order (TRL's
    advantages group consecutive rows by ``num_generations``); ``rayapp_task`` names each row's task
    for the trainer's own reward functions."""
    sizes = [len(g) for g in result.groups]
    if any(s != num_generations for s in sizes) or sum(sizes) != n_prompts:
        raise ValueError(f"rollout {result.rollout_id}: groups of {sizes} samples, but the trainer wants "
                         f"{n_prompts // num_generations} groups of num_generations={num_generations}; set the "
                         "recipe's n_samples_per_prompt to num_generations, rollout_batch_size to the trainer's "
                         "prompts per step, and turn survivorship filters and partial rollouts off")
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], SCORE_FIELD: []}
    for g, group in enumerate(result.groups):
        for sample in group:
            row = _completion(sample, f"rollout {result.rollout_id}, group {g}, sample {sample.task_id}"
                                      f"#{sample.index}", pad_id)
            for key, value in zip(out, row, strict=True):
                out[key].append(value)
    out[TASK_FIELD] = [s.task_id for group in result.groups for s in group]
    return out


def eval_rows(result: EvalResult, num_generations: int, pad_id: int = 0) -> dict[str, list]:
    """An eval step as TRL rows: each eval set's samples in order, the copies of one prompt
    (``n_samples_per_eval_prompt`` of them, which must be TRL's ``num_generations_eval``) a group."""
    groups = []
    for name, samples in result.samples.items():
        for k in range(0, len(samples), num_generations):
            group = samples[k:k + num_generations]
            if len(group) != num_generations or len({s.task_id for s in group}) != 1:
                raise ValueError(f"eval {result.rollout_id}: eval set {name!r} does not come in groups of "
                                 f"num_generations_eval={num_generations} copies of a prompt; set the recipe's "
                                 f"scheduler.n_samples_per_eval_prompt to num_generations_eval")
            groups.append(group)
    n = sum(map(len, groups))
    return to_trl(RolloutResult(result.rollout_id, groups), num_generations, n, pad_id)


def rayapp_eval_prompts(n_prompts: int, placeholder: str = "(rayapp's eval)") -> list[dict[str, str]]:
    """TRL's eval dataset rows (``Dataset.from_list``) for an eval served by rayapp: its size counts
    the eval step's prompts (every eval set's ``n_prompts`` together); the text is not used."""
    return [{"prompt": placeholder}] * n_prompts


class _HeldEval(msgspec.Struct):
    """The eval step one TRL evaluation hands out, batch by batch."""

    eval_id: int
    rows: dict[str, list]
    metrics: dict[str, float]
    cursor: int = 0


class RayappRolloutFunc:
    """``rollout_func`` for ``GRPOTrainer``: each generation is rayapp's rollout step for the
    trainer's step, each eval batch the next rows of its eval step (module docstring). ``prompts``
    unset: rayapp's data source chooses the tasks; a ``TrainerPrompts``: the trainer's prompts are
    the tasks. ``asked`` records (global_step, rollout_id) per rollout, ``evaluated`` per eval step."""

    def __init__(self, source: Any, *, prompts: TrainerPrompts | None = None, first_rollout_id: int = 0,
                 timeout_s: float = 600.0):
        if not callable(getattr(source, "rollout", None)):
            raise TypeError(f"RayappRolloutFunc: source needs a rollout(rollout_id) method, got {type(source)!r}")
        if getattr(source, "filters", None):  # an in-process StepRunner; the Serve app's are checked by count
            raise ValueError(f"RayappRolloutFunc: the step runner has survivorship filters {source.filters}; "
                             "TRL needs every group at num_generations, turn them off in the recipe")
        if prompts is not None and not isinstance(prompts, TrainerPrompts):
            raise TypeError(f"RayappRolloutFunc: prompts must be a TrainerPrompts or None, got {type(prompts)!r}")
        self.source, self.prompts = source, prompts
        self.first_rollout_id, self.timeout_s = first_rollout_id, timeout_s
        self.asked: list[tuple[int, int]] = []
        self.evaluated: list[tuple[int, int]] = []
        self._eval: _HeldEval | None = None

    def rollout_id(self, trainer: Any) -> int:
        return self.first_rollout_id + trainer.state.global_step // steps_per_rollout(trainer)

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        if trainer.accelerator.num_processes != 1:
            raise ValueError("RayappRolloutFunc: one training process only (each process would ask for the "
                             "whole step)")
        if getattr(trainer, "tools", None):
            raise ValueError("RayappRolloutFunc: unset GRPOTrainer's tools/environment_factory; rayapp's agents run "
                             "the tools, and TRL reads the env mask only without its own")
        pad_id = getattr(trainer.processing_class, "pad_token_id", None)
        pad_id = pad_id if pad_id is not None else 0
        if not trainer.model.training:
            return self._eval_batch(len(prompts), trainer, pad_id)
        rollout_id = self.rollout_id(trainer)
        self.asked.append((trainer.state.global_step, rollout_id))
        g = trainer.num_generations
        tasks = self.prompts.tasks(prompts, g) if self.prompts is not None else None
        args = (rollout_id,) if tasks is None else (rollout_id, tasks)
        result = _call(self.source.rollout, args, self.timeout_s, f"rollout {rollout_id}")
        got = [group[0].task_id if group else None for group in result.groups]
        if tasks is not None and got != [t.task_id for t in tasks]:
            raise ValueError(f"rollout {rollout_id}: its groups are tasks {got}, not the trainer's "
                             f"{[t.task_id for t in tasks]}")
        return to_trl(result, g, len(prompts), pad_id)

    def _eval_batch(self, n: int, trainer: Any, pad_id: int) -> dict[str, Any]:
        """The next ``n`` rows of the eval step for the trainer's step: asked for at an evaluation's
        first batch (a new step, or the last one handed out whole), then handed out in order."""
        eval_id, g = self.rollout_id(trainer), trainer.num_generations_eval
        held = self._eval
        if held is None or held.eval_id != eval_id or held.cursor >= len(held.rows[SCORE_FIELD]):
            if not callable(getattr(self.source, "evaluate", None)):
                raise TypeError(f"RayappRolloutFunc: TRL's eval loop needs a source with evaluate(rollout_id), "
                                f"got {type(self.source)!r}")
            self.evaluated.append((trainer.state.global_step, eval_id))
            result = _call(self.source.evaluate, (eval_id,), self.timeout_s, f"eval {eval_id}")
            rows = eval_rows(result, g, pad_id)
            prompts = len(rows[SCORE_FIELD]) // g
            dataset = getattr(trainer, "eval_dataset", None)
            if isinstance(dataset, dict):
                raise ValueError("RayappRolloutFunc: TRL's eval is served by rayapp's eval step; give GRPOTrainer "
                                 f"one eval dataset, rayapp_eval_prompts({prompts}), not several")
            if hasattr(dataset, "__len__") and len(dataset) != prompts:
                raise ValueError(f"eval {eval_id}: TRL's eval dataset has {len(dataset)} prompts and rayapp's eval "
                                 f"step {prompts}; make it rayapp_eval_prompts({prompts})")
            metrics = {f"rayapp/{k.removeprefix('eval/')}": v for k, v in result.metrics.items()}
            held = self._eval = _HeldEval(eval_id, rows, metrics)
        total = len(held.rows[SCORE_FIELD])
        if held.cursor + n > total:
            raise ValueError(f"eval {eval_id}: TRL asked for rows {held.cursor}..{held.cursor + n - 1} of the eval "
                             f"step's {total}; its eval dataset must hold rayapp_eval_prompts({total // g})")
        out: dict[str, Any] = {k: v[held.cursor:held.cursor + n] for k, v in held.rows.items()}
        held.cursor += n
        out[EVAL_FIELD] = held.metrics  # not a list: TRL puts it on every row, and rayapp_reward logs it
        return out


def rayapp_reward(completions: list, rayapp_score: list[float | None], rayapp_eval: list | None = None,
                  log_metric: Callable[[str, float], None] | None = None, **kwargs: Any) -> list[float | None]:
    """The reward function for ``reward_funcs``: rayapp's score of each completion (None: unscored).
    In an eval batch, also the eval step's metrics, through TRL's ``log_metric`` (``eval_rayapp/...``)."""
    if rayapp_eval and log_metric is not None:
        for name, value in rayapp_eval[0].items():
            log_metric(name, value)
    return list(rayapp_score)


class WeightSyncCallback(TrainerCallback):
    """At the start of training and after each optimizer step: the model saved with
    ``save_pretrained`` into ``folder/step-NNNNNN``, then ``update(path)`` (e.g.
    ``ServeManager.update_weights``: every replica loads it between steps). The sync at the start
    puts the engines on the trainer's weights before the first rollout: engines that served an
    earlier run keep its final weights (a restarted app starts from the model again, a running one
    does not), and the first step would otherwise train on their samples. ``synced`` records
    (global_step, path); ``folder`` must lie inside the engine's ``weight_roots``."""

    def __init__(self, update: Callable[[str], Any], folder: str | Path, *, timeout_s: float = 600.0):
        self.update, self.folder, self.timeout_s = update, Path(folder), timeout_s
        self.synced: list[tuple[int, str]] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._sync(state.global_step, model, "the start of training")

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._sync(state.global_step, model, f"step {state.global_step}")

    def _sync(self, step: int, model: Any, when: str) -> None:
        path = self.folder / f"step-{step:06d}"
        model.save_pretrained(path, safe_serialization=True)
        replies = _call(self.update, (str(path),), self.timeout_s, f"weight update to {path}")
        # the manager answers one reply per replica, an engine in process one reply
        replies = replies if isinstance(replies, list) else [replies]
        failed = [r for r in replies if isinstance(r, dict) and not r.get("ok", True)]
        if failed:
            raise RuntimeError(f"{when}: weight update to {path} failed on {failed}")
        self.synced.append((step, str(path)))
