"""rayapp.trainers.slime without an engine: aborted and removed samples, slime's group shape,
log-probs on all or none, the weight checkpoints it needs and its eval step ids, timeouts, the
Serve source's calls, and that the package imports no slime. Skipped without slime (docs/trainers.md,
slime); tests/test_trainer_slime.py drives the adapter with slime's own manager code."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from argparse import Namespace
from types import SimpleNamespace as NS

import pytest

pytest.importorskip("slime.utils.types", reason="slime is installed from its source: docs/trainers.md, slime")

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.utils.types import Sample as SlimeSample

from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.trainers.slime import ServeSource, eval_step, generate_rollout, train_samples
from rayapp.types import Sample, Status


def test_slime_prompts_need_a_task_type_and_a_prompt():
    args = Namespace(rollout_batch_size=1, n_samples_per_prompt=1, rayapp_prompts="slime", rayapp_sync_weights=False,
                     rayapp_source=NS(rollout=lambda i, tasks=None: None))
    source = NS(get_samples=lambda n: [[SlimeSample(group_index=0, index=0)]])
    with pytest.raises(ValueError, match="rollout 2: rayapp_prompts: slime needs rayapp_task_type"):
        generate_rollout(args, 2, source)
    args.rayapp_task_type = "math"
    with pytest.raises(ValueError, match=r"rollout 2: slime's data source gave group 0 no prompt \(set --prompt-data"):
        generate_rollout(args, 2, source)
    args.rayapp_prompts = "trainer"
    with pytest.raises(ValueError, match=r"rayapp_prompts must be one of \('rayapp', 'slime'\), got 'trainer'"):
        generate_rollout(args, 2, source)


def result_of(*groups) -> RolloutResult:
    return RolloutResult(3, [list(g) for g in groups])


def sample(index, tokens=(1, 2, 3), n=1, score=1.0, status=Status.COMPLETED, removed=False, log_probs=True):
    return Sample("t", index, "p", status=status, tokens=list(tokens), response_length=n, loss_mask=[1] * n,
                  rollout_log_probs=[-0.5] * n if log_probs else [], remove_sample=removed,
                  reward={} if score is None else {"score": score})


def test_aborted_and_removed_samples_stay_in_their_group_out_of_the_loss():
    args = Namespace(rollout_batch_size=1, n_samples_per_prompt=3, reward_key=None, rayapp_pad_token_id=9)
    aborted = sample(1, tokens=(), n=0, score=None, status=Status.ABORTED, log_probs=False)
    (group,) = train_samples(args, result_of([sample(0), aborted, sample(2, score=1.0, removed=True)]))
    assert [s.remove_sample for s in group] == [False, True, True] and [s.reward for s in group] == [1.0, 0.0, 0.0]
    assert (group[1].tokens, group[1].response_length, group[1].loss_mask, group[1].rollout_log_probs) == \
        ([9, 9], 1, [0], [0.0])
    keyed = Namespace(**{**vars(args), "reward_key": "score"})  # slime reads the key itself: the dicts go as they are
    assert [s.reward for s in train_samples(keyed, result_of([sample(0), aborted, sample(2)]))[0]] == \
        [{"score": 1.0}, {"score": 0.0}, {"score": 1.0}]


def test_a_step_off_slimes_shape_or_with_log_probs_on_some_samples_is_one_clear_error():
    args = Namespace(rollout_batch_size=2, n_samples_per_prompt=2, reward_key=None)
    with pytest.raises(ValueError, match=r"rollout 3: groups of \[2, 1\] samples, but slime wants "
                                         r"rollout_batch_size=2 groups of n_samples_per_prompt=2"):
        train_samples(args, result_of([sample(0), sample(1)], [sample(0)]))
    with pytest.raises(ValueError, match="rollout 3: rollout_log_probs on 3 of 4 samples"):
        train_samples(args, result_of([sample(0), sample(1)], [sample(0), sample(1, log_probs=False)]))


def test_weights_need_slimes_hf_checkpoint_of_every_step(tmp_path):
    asked = []
    source = NS(update_weights=lambda path: asked.append(path) or {"ok": True},
                rollout=lambda i: result_of([sample(0)]), evaluate=lambda i: EvalResult(i, {}, {}))
    args = Namespace(rollout_batch_size=1, n_samples_per_prompt=1, reward_key=None, eval_reward_key=None,
                     save_hf=None, save_interval=None, rayapp_source=source)
    # step 0: the engines load the weights slime starts from (they may hold an earlier run's)
    with pytest.raises(ValueError, match=r"rollout 0: rayapp's engines load the weights slime starts from .*: set "
                                         r"--hf-checkpoint"):
        generate_rollout(args, 0, None)
    args.hf_checkpoint = str(tmp_path / "base")
    with pytest.raises(FileNotFoundError, match=r"rollout 0: the start weights .*base is not there \(--hf-checkpoint"):
        generate_rollout(args, 0, None)
    (tmp_path / "base").mkdir()
    assert isinstance(generate_rollout(args, 0, None), RolloutFnTrainOutput)
    assert asked == [str(tmp_path / "base")]
    with pytest.raises(ValueError, match=r"set --save-hf \(a path with \{rollout_id\}\) and --save-interval 1"):
        generate_rollout(args, 1, None)
    args.save_hf, args.save_interval = str(tmp_path / "iter_{rollout_id}"), 1
    with pytest.raises(FileNotFoundError, match=r"rollout 2: slime's checkpoint .*iter_1 is not there"):
        generate_rollout(args, 2, None)
    (tmp_path / "iter_1").mkdir()
    generate_rollout(args, 2, None)
    generate_rollout(args, 2, None)  # asked again: the engines already hold it
    assert asked == [str(tmp_path / "base"), str(tmp_path / "iter_1")]
    # slime evaluates before training at 0 (no checkpoint yet: on the start weights) and after each
    # step: two eval steps of rayapp
    assert eval_step(args, 0, source) == 0 and asked[-1] == str(tmp_path / "base")
    (tmp_path / "iter_0").mkdir()
    assert eval_step(args, 0, source) == 1 and asked[-1] == str(tmp_path / "iter_0")
    source.update_weights = lambda path: [{"ok": True}, {"ok": False, "error": "bad shard"}]
    with pytest.raises(RuntimeError, match=r"eval 1: weight update to .*iter_1 failed on .*bad shard"):
        eval_step(args, 1, source)
    args.rayapp_sync_weights = False
    assert isinstance(generate_rollout(args, 5, None), RolloutFnTrainOutput)


def test_a_source_that_does_not_answer_in_time_is_a_timeout_naming_the_step():
    class Stuck:
        async def rollout(self, rollout_id):
            await asyncio.sleep(60)

    args = Namespace(rollout_batch_size=1, n_samples_per_prompt=1, rayapp_source=Stuck(), rayapp_timeout_s=0.2,
                     rayapp_sync_weights=False)
    with pytest.raises(TimeoutError, match=r"rollout 4 did not finish within 0\.2s"):
        generate_rollout(args, 4, None)


def test_the_serve_source_calls_the_manager_with_a_timeout_on_every_call():
    calls = []

    def method(name):
        def remote(*args):
            return NS(result=lambda timeout_s: calls.append((name, args, timeout_s)) or [{"ok": True}])
        return NS(remote=remote)

    source = ServeSource(NS(generate=method("generate"), evaluate=method("evaluate"),
                            update_weights_from_disk=method("update")), engine="student", timeout_s=42)
    source.rollout(3)
    source.rollout(4, [{"task_id": "a"}])
    source.evaluate(5)
    source.update_weights("/ckpt/hf/iter_4")
    assert calls == [("generate", (3,), 42), ("generate", (4, [{"task_id": "a"}]), 42),
                     ("evaluate", (5,), 42), ("update", ("student", "/ckpt/hf/iter_4"), 42)]


def test_the_package_imports_no_slime():
    code = ("import sys, rayapp, rayapp.trainers; "
            "sys.exit(sorted(m for m in sys.modules if m.split('.')[0] == 'slime') or None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
