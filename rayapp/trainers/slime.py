"""slime (THUDM/slime v0.3.1, commit a6272da0d4f3d0a08520c99a2f3b4f6c887960dc) taking its rollouts
from rayapp.

It exists so a slime run trains on rayapp's rollouts with one flag:
``--rollout-function-path rayapp.trainers.slime.generate_rollout``. slime's ``RolloutManager`` calls
it through ``call_rollout_fn`` and gets ``rollout_batch_size`` groups of ``n_samples_per_prompt``
slime ``Sample``s (or, for eval, per dataset its rewards, truncated flags and samples); its settings
are attributes of slime's ``args`` (``SETTINGS`` holds the defaults). Invariant: slime's rollout id is
rayapp's step id, so a step asked for again is the same samples. What the adapter decides where the
two contracts differ (prompts, group shape, aborted samples, rewards, weights): docs/trainers.md, slime.
"""

from __future__ import annotations

import os
from typing import Any

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.utils.types import Sample as SlimeSample

from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.trainers.converters import to_slime
from rayapp.trainers.sync import ServeManager, wait
from rayapp.types import Status

# The adapter's settings, read from slime's args (``--custom-config-path`` YAML), with their defaults.
SETTINGS: dict[str, Any] = {
    "rayapp_app": "rayapp",          # the Serve application's name (in slime's Ray cluster)
    "rayapp_engine": "student",      # the engine that serves the policy being trained
    "rayapp_timeout_s": 3600.0,      # per call: a rollout step, an eval step, a weight update
    "rayapp_reward_key": "score",    # the reward entry slime trains on
    "rayapp_pad_token_id": 0,        # the token that stands in for an aborted sample's empty response
    "rayapp_sync_weights": True,     # load slime's --save-hf checkpoint before each step
    "rayapp_start_weights": None,    # the Hugging Face folder slime starts from (None: --hf-checkpoint)
    "rayapp_source": None,           # an in-process source (tests, a single-process run); else the Serve app
    "rayapp_prompts": "rayapp",      # whose data source chooses a step's prompts: "rayapp" or "slime"
    "rayapp_task_type": None,        # with "slime": the task type (evaluator) rayapp runs them as
}
PROMPTS = ("rayapp", "slime")


def setting(args: Any, name: str) -> Any:
    return getattr(args, name, SETTINGS[name])


class ServeSource(ServeManager):
    """The Serve manager's handle as the adapter's source (a timeout on every call), remembering the
    checkpoint its engine replicas were last told to load."""

    def __init__(self, handle: Any, *, engine: str, timeout_s: float):
        super().__init__(handle, engine=engine, timeout_s=timeout_s)
        self.loaded: str | None = None


_SERVE: dict[str, ServeSource] = {}  # one per application, for the life of slime's RolloutManager


def source_of(args: Any) -> Any:
    """``rayapp_source`` when set, else the Serve application ``rayapp_app`` (looked up once)."""
    given = setting(args, "rayapp_source")
    if given is not None:
        return given
    app = setting(args, "rayapp_app")
    if app not in _SERVE:
        from rayapp.connection import manager_handle  # a Serve handle: an in-process source needs no Ray

        timeout_s = float(setting(args, "rayapp_timeout_s"))  # waiting for the manager to come up is such a call
        _SERVE[app] = ServeSource(manager_handle(app, timeout_s), engine=setting(args, "rayapp_engine"),
                                  timeout_s=timeout_s)
    return _SERVE[app]


def checkpoint(args: Any, step: int) -> str:
    """Where slime's ``--save-hf`` put the weights it had after training step ``step``."""
    template = getattr(args, "save_hf", None)
    if not template or getattr(args, "save_interval", None) != 1:
        raise ValueError(f"rayapp's engines get slime's weights from its --save-hf checkpoint of each step: "
                         f"set --save-hf (a path with {{rollout_id}}) and --save-interval 1 (got save_hf="
                         f"{template!r}, save_interval={getattr(args, 'save_interval', None)!r}), or "
                         "rayapp_sync_weights: false")
    return template.format(rollout_id=step)


def start_weights(args: Any) -> str:
    """The weights slime trains from at step 0, which the engines load before it: ``rayapp_start_weights``,
    else ``--hf-checkpoint``."""
    path = setting(args, "rayapp_start_weights") or getattr(args, "hf_checkpoint", None)
    if not path:
        raise ValueError("rollout 0: rayapp's engines load the weights slime starts from before its first step: set "
                         "--hf-checkpoint (or rayapp_start_weights, a Hugging Face folder), or rayapp_sync_weights: "
                         "false")
    return str(path)


def load_weights(args: Any, source: Any, path: str, what: str, whose: str = "slime's checkpoint") -> bool:
    """Every replica loads ``path``, unless it was the last one loaded; True when it was loaded."""
    if getattr(source, "loaded", None) == path:
        return False
    if not os.path.isdir(path):
        origin = f"--save-hf {args.save_hf!r}" if whose == "slime's checkpoint" else "--hf-checkpoint"
        raise FileNotFoundError(f"{what}: {whose} {path} is not there ({origin})")
    replies = wait(source.update_weights(path), float(setting(args, "rayapp_timeout_s")),
                         f"{what}: weight update to {path}")
    replies = replies if isinstance(replies, list) else [replies]  # one per replica, or an engine's one
    failed = [r for r in replies if isinstance(r, dict) and not r.get("ok", True)]
    if failed:
        raise RuntimeError(f"{what}: weight update to {path} failed on {failed}")
    source.loaded = path
    return True


def eval_step(args: Any, rollout_id: int, source: Any) -> int:
    """slime evaluates after training step ``rollout_id`` (its checkpoint is written by then), and
    once before any training at 0 (on the weights slime starts from): rayapp's eval step is the number
    of training steps in the weights (``rollout_id + 1``, or 0 before training), so the two evals at 0
    are two steps, each idempotent."""
    if not setting(args, "rayapp_sync_weights"):
        return rollout_id
    path = checkpoint(args, rollout_id)
    if rollout_id == 0 and not os.path.isdir(path):  # before training: the weights slime starts from
        load_weights(args, source, start_weights(args), "eval 0", "the start weights")
        return 0
    load_weights(args, source, path, f"eval {rollout_id}")
    return rollout_id + 1


def _slime_key(args: Any, evaluation: bool) -> str | None:
    """The key slime reads a reward dict with (``--reward-key``, ``--eval-reward-key``); None: a float."""
    return (getattr(args, "eval_reward_key", None) if evaluation else None) or getattr(args, "reward_key", None)


def _samples(args: Any, result: RolloutResult, evaluation: bool, where: str) -> list[SlimeSample]:
    """slime Samples of ``result``'s samples in order (``to_slime``'s dicts): rewards as slime reads
    them, an aborted or removed sample out of the loss with reward 0 (module docstring), log-probs on
    all or none."""
    slime_key = _slime_key(args, evaluation)
    # rayapp's whole reward dict when slime picks the entry itself, else the trained entry as a float
    dicts = to_slime(result, reward_key=None if slime_key else setting(args, "rayapp_reward_key"))
    pad_id = int(setting(args, "rayapp_pad_token_id"))
    for d in dicts:
        if d["status"] == Status.ABORTED.value or d["remove_sample"]:
            d |= {"remove_sample": True, "reward": {**d["reward"], slime_key: 0.0} if slime_key else 0.0}
            if d["response_length"] == 0:  # slime trains on prompt + at least one response token
                d |= {"tokens": (d["tokens"] or [pad_id]) + [pad_id], "response_length": 1, "loss_mask": [0],
                      "rollout_log_probs": [0.0]}
    with_lp = sum(d["rollout_log_probs"] is not None for d in dicts)
    if 0 < with_lp < len(dicts):
        raise ValueError(f"{where}: rollout_log_probs on {with_lp} of {len(dicts)} samples; slime reads them "
                         "from every sample or none")
    return [SlimeSample.from_dict(d) for d in dicts]


def slime_tasks(args: Any, rollout_id: int, data_source: Any) -> tuple[list[dict], list[list[SlimeSample]]]:
    """The next ``rollout_batch_size`` groups of slime's data source, and each as a rayapp task (a
    dict of a Task's fields; the manager checks it where outside input is checked)."""
    task_type = setting(args, "rayapp_task_type")
    if not isinstance(task_type, str) or not task_type:
        raise ValueError(f"rollout {rollout_id}: rayapp_prompts: slime needs rayapp_task_type, the task type "
                         f"(evaluator) rayapp runs slime's prompts as; got {task_type!r}")
    groups = data_source.get_samples(args.rollout_batch_size)
    tasks = []
    for g, group in enumerate(groups):
        first = group[0]
        if not first.prompt:
            raise ValueError(f"rollout {rollout_id}: slime's data source gave group {g} no prompt (set --prompt-data "
                             "and --input-key, and keep --rollout-global-dataset on)")
        tasks.append({"task_id": f"slime-{first.group_index}", "prompt": first.prompt, "label": first.label,
                      "config": {"task_type": task_type, "n_samples": len(group)},
                      "metadata": dict(first.metadata or {})})
    return tasks, groups


def train_samples(args: Any, result: RolloutResult,
                  given: list[list[SlimeSample]] | None = None) -> list[list[SlimeSample]]:
    """Rollout step ``result`` as slime's ``samples`` (module docstring: groups, ids, aborts); with
    ``given``, the data source's groups the step ran, their ids."""
    n, groups = args.n_samples_per_prompt, args.rollout_batch_size
    sizes = [len(g) for g in result.groups]
    if len(sizes) != groups or any(s != n for s in sizes):
        raise ValueError(f"rollout {result.rollout_id}: groups of {sizes} samples, but slime wants "
                         f"rollout_batch_size={groups} groups of n_samples_per_prompt={n}; set the recipe's "
                         "n_samples_per_prompt and rollout_batch_size to these, and turn survivorship filters "
                         "and partial rollouts off")
    flat = _samples(args, result, False, f"rollout {result.rollout_id}")
    for k, s in enumerate(flat):
        if given is None:
            s.group_index = result.rollout_id * groups + k // n
            s.index = s.group_index * n + k % n
        else:
            s.group_index, s.index = given[k // n][k % n].group_index, given[k // n][k % n].index
    return [flat[g * n:(g + 1) * n] for g in range(groups)]


def eval_data(args: Any, result: EvalResult) -> dict[str, dict[str, Any]]:
    """Eval step ``result`` as slime's eval ``data``: per dataset its rewards (an aborted sample's is
    0), whether each sample was cut at its token limit, and its samples."""
    slime_key, out = _slime_key(args, True), {}
    for name, samples in result.samples.items():
        if not samples:
            continue
        ss = _samples(args, RolloutResult(result.rollout_id, [samples]), True,
                      f"eval {result.rollout_id}, dataset {name!r}")
        for k, s in enumerate(ss):
            s.group_index, s.index = None, k
        out[name] = {"rewards": [float(s.reward[slime_key] if slime_key else s.reward) for s in ss],
                     "truncated": [s.status == SlimeSample.Status.TRUNCATED for s in ss], "samples": ss}
    return out


def generate_rollout(args: Any, rollout_id: int, data_source: Any,
                     evaluation: bool = False) -> RolloutFnTrainOutput | RolloutFnEvalOutput:
    """slime's rollout function (``--rollout-function-path``; ``--eval-function-path`` too): rollout
    step ``rollout_id`` (or eval step, with ``evaluation``) of rayapp, after loading the weights slime
    trained up to it. ``data_source`` is slime's: with ``rayapp_prompts: slime`` it chooses the
    step's prompts, else rayapp's own does."""
    prompts = setting(args, "rayapp_prompts")
    if prompts not in PROMPTS:
        raise ValueError(f"rayapp_prompts must be one of {PROMPTS}, got {prompts!r}")
    source, timeout_s = source_of(args), float(setting(args, "rayapp_timeout_s"))
    if evaluation:
        step = eval_step(args, rollout_id, source)
        result = wait(source.evaluate(step), timeout_s, f"eval {step}")
        return RolloutFnEvalOutput(data=eval_data(args, result), metrics=dict(result.metrics))
    if setting(args, "rayapp_sync_weights"):  # step 0: the weights slime starts from; then its checkpoints
        if rollout_id == 0:
            load_weights(args, source, start_weights(args), "rollout 0", "the start weights")
        else:
            load_weights(args, source, checkpoint(args, rollout_id - 1), f"rollout {rollout_id}")
    if prompts == "rayapp":
        result = wait(source.rollout(rollout_id), timeout_s, f"rollout {rollout_id}")
        return RolloutFnTrainOutput(samples=train_samples(args, result), metrics=dict(result.metrics))
    tasks, groups = slime_tasks(args, rollout_id, data_source)
    result = wait(source.rollout(rollout_id, tasks), timeout_s, f"rollout {rollout_id}")
    return RolloutFnTrainOutput(samples=train_samples(args, result, groups), metrics=dict(result.metrics))

