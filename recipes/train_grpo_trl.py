"""The GRPO demo of ``recipes/train_grpo.py`` with TRL's own ``GRPOTrainer`` as the trainer, on CPU.

    python recipes/train_grpo_trl.py                  # starts a local Ray head and the app, then trains
    python recipes/train_grpo_trl.py --address auto   # against an app already running (a fresh one:
                                                      # rollout ids start at 0, and steps are idempotent)

Both trainers' held-out curves on one plot, from the two runs' histories:

    python recipes/plot_runs.py built-in=/tmp/rayapp-train/history.json trl=/tmp/rayapp-train-trl/history.json \
        -o docs/training_trl.png --title "GRPO on the tiny model (CPU): rayapp's trainer and TRL's"

Same app (``recipes/train_grpo/rollout.yaml``: the math env's calculator agent on the tiny model, two
engine replicas), same step (16 prompts x 8 samples), same hyper-parameters (lr 1e-3, AdamW betas
0.9/0.99, no weight decay, grad-norm 1.0, clip 0.2, temperature 1.0, two optimiser steps per rollout)
and the same held-out eval (``evaluate(k)`` through the handle, greedy, 128 problems) as the built-in
trainer. What differs is only the trainer: TRL 1.16's ``GRPOTrainer`` loop takes its rollouts through
``rayapp.trainers.trl`` (``RayappRolloutFunc`` over ``ServeManager``), and its ``WeightSyncCallback``
loads each optimiser step's weights on both replicas. It writes ``history.json`` (the keys of
``train_grpo.py``'s) in the run folder and, when the built-in run's history is there, one plot with
both runs' held-out accuracy (``training_trl.png``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # 127.0.0.1 only on one machine
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # rayapp (and train_grpo beside this file) from this checkout
sys.path.insert(0, str(ROOT / "recipes"))

import plot_runs  # noqa: E402
from train_grpo import RECIPES, evaluate, stale_samples, tool_share, with_app  # noqa: E402

TITLE = "GRPO on the tiny model (CPU): rayapp's trainer and TRL's"

PER_STEP, GROUP = 16, 8  # the recipe's rollout_batch_size and n_samples_per_prompt


class Recording:
    """``ServeManager`` keeping the last step's groups, for the history's reward and tool figures."""

    def __init__(self, manager):
        self.manager, self.last = manager, None

    def rollout(self, rollout_id, tasks=None):
        self.last = self.manager.rollout(rollout_id, tasks)
        return self.last


def train(handle, args: argparse.Namespace) -> list[dict]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rayapp.inference.tiny_model import ensure_tiny_model, quiet_progress
    from rayapp.trainers.trl import RayappRolloutFunc, ServeManager, WeightSyncCallback, rayapp_reward

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    manager = ServeManager(handle, timeout_s=args.timeout)
    source = Recording(manager)
    t0 = time.monotonic()
    history = [{"step": 0, "t": 0.0, **evaluate(handle, 0, args.timeout)}]
    print(f"[{0.0:6.1f}s] step 0 (pretrained) held-out accuracy: arithmetic {history[0]['acc_arithmetic']:.3f}, "
          f"word {history[0]['acc_word']:.3f}", flush=True)
    per_rollout = args.micro_steps  # optimiser steps per rollout: TRL's steps_per_generation

    class Report(TrainerCallback):
        """Per rollout (every ``per_rollout`` optimiser steps, after the weight sync): the step's
        figures, the eval every ``eval_every`` rollouts, and the time budget, as train_grpo.py."""

        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step % per_rollout:
                return
            step = state.global_step // per_rollout
            groups = source.last.groups
            scores = [s.reward.get("score", 0.0) for g in groups for s in g]
            row = {"step": step, "t": round(time.monotonic() - t0, 1), "reward_mean": sum(scores) / len(scores),
                   "tool_share": tool_share(groups),
                   # the manager counts weight updates: per_rollout of them before this step's rollout
                   "stale_samples": float(stale_samples(groups, per_rollout * (step - 1)))}
            line = (f"[{row['t']:6.1f}s] step {step}: reward {row['reward_mean']:.3f}, calculator called on "
                    f"{row['tool_share']:.2f} of arithmetic, off-version {int(row['stale_samples'])}, replicas "
                    f"synced at optimiser step {sync.synced[-1][0]}")
            over = args.budget_s and time.monotonic() - t0 > args.budget_s
            if step % args.eval_every == 0 or step == args.steps or over:
                row |= evaluate(handle, step, args.timeout)
                line += f"; held-out accuracy: arithmetic {row['acc_arithmetic']:.3f}, word {row['acc_word']:.3f}"
            print(line, flush=True)
            history.append(row)
            if over:
                print(f"time budget of {args.budget_s:.0f}s spent after step {step}", flush=True)
                control.should_training_stop = True

    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()), local_files_only=True)
    sync = WeightSyncCallback(manager.update_weights, run / "weights", timeout_s=args.timeout)
    config = GRPOConfig(
        output_dir=str(run / "trl"), max_steps=args.steps * per_rollout, num_generations=GROUP,
        # one generation of 16 x 8 feeds per_rollout optimiser steps on equal slices, as the built-in trainer
        per_device_train_batch_size=PER_STEP * GROUP // per_rollout, steps_per_generation=per_rollout,
        learning_rate=args.lr, lr_scheduler_type="constant", adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0,
        epsilon=args.clip_eps, beta=0.0, temperature=1.0, loss_type="dapo", logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=True, seed=args.seed, dataloader_num_workers=0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[rayapp_reward], args=config,
                          rollout_func=RayappRolloutFunc(source, timeout_s=args.timeout),
                          # rayapp's data source chooses the prompts; these rows only count the groups
                          train_dataset=Dataset.from_dict({"prompt": ["(rayapp chooses)"] * PER_STEP}),
                          callbacks=[sync, Report()])  # the sync first: the eval sees the new weights
    trainer.train()
    (run / "history.json").write_text(json.dumps(history, indent=1))
    first, last = history[0], history[-1]
    print(f"held-out accuracy (arithmetic problems): {first['acc_arithmetic']:.3f} -> {last['acc_arithmetic']:.3f}; "
          f"word problems {first['acc_word']:.3f} -> {last['acc_word']:.3f}; history {run / 'history.json'}",
          flush=True)
    builtin = Path(args.builtin_history)
    if builtin.exists():  # make demo-train ran before: both trainers on one plot
        plot_runs.main([f"built-in={builtin}", f"trl={run / 'history.json'}", "-o", str(run / "training_trl.png"),
                        "--title", TITLE])
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="a running cluster with a fresh app; unset: start a local one")
    p.add_argument("--recipe", default=str(RECIPES["native"]))
    p.add_argument("--app", default="rayapp")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps (each one rollout)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop after the step that passes this (0: none)")
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--micro-steps", type=int, default=2, help="optimiser steps per rollout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each call through the handle")
    p.add_argument("--run-dir", default="/tmp/rayapp-train-trl", help="inside the recipe's weight_roots")
    p.add_argument("--builtin-history", default="/tmp/rayapp-train/history.json",
                   help="the built-in trainer's run (make demo-train), drawn beside this one")
    p.add_argument("--temp-dir", default=None, help="Ray's session folder for a local head")
    p.add_argument("--verbose", action="store_true", help="Ray's and Serve's lines on the terminal too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return with_app(train, args, "rayapp-train-trl")


if __name__ == "__main__":
    sys.exit(main())
