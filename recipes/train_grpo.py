"""GRPO through the whole stack, on CPU: the trainer's side of rayapp.

    python recipes/train_grpo.py                      # starts a local Ray head and the app, then trains
    python recipes/train_grpo.py --address auto       # against an app already running
    python recipes/train_grpo.py --agent gateway      # the example OpenAI agent through the gateway

Each step: ``generate(k)`` through the manager's handle (16 prompts x 8 samples of the math env's
calculator agent), a GRPO update on the tiny model (``rayapp.trainers.grpo``), the new weights saved
as safetensors and loaded by every engine replica (``update_weights_from_disk`` through the manager),
then, every few steps, ``evaluate(k)`` on held-out problems. It prints, per step, the mean reward, the
largest difference between the recomputed and the rollout log-probs before the update (~1e-6: tokens
and log-probs line up), the weight version on every replica and on the samples, and the held-out
accuracy; it writes ``history.json`` in the run folder after every step (a run cut short keeps its
rows) and at the end (with matplotlib) ``train_grpo.png``. ``--agent gateway`` runs the same demo with
``recipes/train_grpo/gateway.yaml``: the episodes are the example agent of ``examples/openai_agent``
(it imports only openai) calling the engine through the manager's gateway; ``recipes/plot_runs.py``
draws two runs' held-out accuracy on one plot.
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
RECIPES = {"native": ROOT / "recipes" / "train_grpo" / "rollout.yaml",
           "gateway": ROOT / "recipes" / "train_grpo" / "gateway.yaml"}
EXAMPLE_AGENT = ROOT / "examples" / "openai_agent"  # the gateway recipe's agent package


def accuracy(samples: list, kind: str | None = None) -> float:
    """Mean score of the samples (of one problem kind when given), aborted ones counting 0."""
    picked = [s for s in samples if kind is None or s.metadata.get("kind") == kind]
    return sum(s.reward.get("score", 0.0) for s in picked) / max(1, len(picked))


def stale_samples(groups: list, version: int) -> int:
    """Samples with a model turn that did not run on weight version ``version``."""
    return sum(1 for g in groups for s in g
               if any(t.get("weight_version") != version for t in s.metadata.get("_turn_placement", [])))


def tool_share(groups: list) -> float:
    """The share of arithmetic problems' samples that called the calculator (took a second turn)."""
    samples = [s for g in groups for s in g if s.metadata.get("kind") == "arithmetic"]
    return sum(1 for s in samples if s.metadata.get("_turns", 0) > 1) / max(1, len(samples))


def evaluate(handle, eval_id: int, timeout_s: float) -> dict[str, float]:
    ev = handle.evaluate.remote(eval_id).result(timeout_s=timeout_s)
    samples = [s for batch in ev.samples.values() for s in batch]
    return {"acc_arithmetic": accuracy(samples, "arithmetic"), "acc_word": accuracy(samples, "word"),
            "acc_all": accuracy(samples), "eval_samples": float(len(samples))}


def plot(history: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing (the 'plot' extra): no plot written", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history if "reward_mean" in h]
    ax.plot(steps, [h["reward_mean"] for h in history if "reward_mean" in h], label="rollout reward (mean)", alpha=0.7)
    ax.plot(steps, [h["tool_share"] for h in history if "reward_mean" in h], ":", color="grey",
            label="arithmetic rollouts that call the calculator")
    ev = [h for h in history if "acc_arithmetic" in h]
    at = [h["step"] for h in ev]
    ax.plot(at, [h["acc_arithmetic"] for h in ev], "o-", label="held-out accuracy (greedy): arithmetic")
    ax.plot(at, [h["acc_word"] for h in ev], "s--", label="held-out accuracy (greedy): word problems")
    ax.set_xlabel("GRPO step (weights version)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("GRPO on the tiny model through the Serve app (CPU)")
    ax.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(handle, args: argparse.Namespace) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from rayapp.inference.tiny_model import ensure_tiny_model, quiet_progress
    from rayapp.trainers.grpo import GRPOTrainer

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    with quiet_progress():
        model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), local_files_only=True).eval()
    trainer = GRPOTrainer(model, lr=args.lr, clip_eps=args.clip_eps, temperature=1.0, micro_steps=args.micro_steps)
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    history = [{"step": 0, "t": 0.0, **evaluate(handle, 0, args.timeout)}]
    (run / "history.json").write_text(json.dumps(history, indent=1))
    print(f"[{0.0:6.1f}s] step 0 (pretrained) held-out accuracy: arithmetic {history[0]['acc_arithmetic']:.3f}, "
          f"word {history[0]['acc_word']:.3f}", flush=True)
    for step in range(1, args.steps + 1):
        result = handle.generate.remote(step - 1).result(timeout_s=args.timeout)
        stale = stale_samples(result.groups, step - 1)
        m = trainer.step(result.groups)
        folder = trainer.save(run / "weights" / f"step-{step:03d}")
        replies = handle.update_weights_from_disk.remote("student", str(folder)).result(timeout_s=args.timeout)
        versions = sorted(r["version"] for r in replies)
        if not all(r.get("ok") for r in replies) or len(set(versions)) != 1 or versions[0] != step:
            raise RuntimeError(f"step {step}: weight update not on every replica at version {step}: {replies}")
        row = {"step": step, "t": round(time.monotonic() - t0, 1), **m, "tool_share": tool_share(result.groups),
               "stale_samples": float(stale), "replica_versions": versions}
        line = (f"[{row['t']:6.1f}s] step {step}: reward {m['reward_mean']:.3f}, calculator called on "
                f"{row['tool_share']:.2f} of arithmetic, logprob diff before update {m['logprob_diff_first']:.1e} "
                f"(max over micro-steps {m['logprob_diff_max']:.2f}), clipped {m['clip_frac']:.2f}, off-version "
                f"{stale}, replicas at version {versions}")
        if step % args.eval_every == 0 or step == args.steps:
            row |= evaluate(handle, step, args.timeout)
            line += f"; held-out accuracy: arithmetic {row['acc_arithmetic']:.3f}, word {row['acc_word']:.3f}"
        print(line, flush=True)
        history.append(row)
        (run / "history.json").write_text(json.dumps(history, indent=1))  # a run cut short keeps its steps
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            print(f"time budget of {args.budget_s:.0f}s spent after step {step}", flush=True)
            if "acc_arithmetic" not in row:
                row |= evaluate(handle, step, args.timeout)
                (run / "history.json").write_text(json.dumps(history, indent=1))
            break
    png = plot(history, run / "train_grpo.png")
    first, last = history[0], history[-1]
    print(f"held-out accuracy (arithmetic problems): {first['acc_arithmetic']:.3f} -> {last['acc_arithmetic']:.3f}; "
          f"word problems {first['acc_word']:.3f} -> {last['acc_word']:.3f}; history {run / 'history.json'}"
          + (f"; plot {png}" if png else ""), flush=True)
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="a running cluster with the app; unset: start a local one")
    p.add_argument("--agent", choices=sorted(RECIPES), default="native",
                   help="native: the math env's calculator agent; gateway: the example OpenAI agent through the "
                        "gateway (sets the default --recipe)")
    p.add_argument("--recipe", default=None, help="default: the --agent's recipe under recipes/train_grpo/")
    p.add_argument("--app", default="rayapp")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps (each one rollout)")
    p.add_argument("--budget-s", type=float, default=480.0, help="stop after the step that passes this (0: none)")
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-eps", type=float, default=0.2)
    p.add_argument("--micro-steps", type=int, default=2, help="optimiser steps per rollout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each call through the handle")
    p.add_argument("--run-dir", default=None, help="default: /tmp/rayapp-train, with --agent gateway "
                   "/tmp/rayapp-train-gateway (under the recipe's weight_roots: engines load weights from there)")
    p.add_argument("--temp-dir", default=None, help="Ray's session folder for a local head")
    p.add_argument("--verbose", action="store_true", help="Ray's and Serve's lines on the terminal too (serve run's "
                   "output, the driver's own); without it they go only to the serve log")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.recipe = args.recipe or str(RECIPES[args.agent])
    args.run_dir = args.run_dir or ("/tmp/rayapp-train" if args.agent == "native" else "/tmp/rayapp-train-gateway")
    sys.path.insert(0, str(ROOT))  # rayapp from this checkout when it is not installed
    if not args.address:
        from rayapp.inference.tiny_model import ensure_tiny_model

        if args.agent == "gateway":  # the agent is imported where the manager runs: the local head's workers
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLE_AGENT),
                                                                     os.environ.get("PYTHONPATH")]))
        t0 = time.monotonic()
        print(f"tiny model ready at {ensure_tiny_model()} ({time.monotonic() - t0:.1f}s)", flush=True)
    return with_app(train, args, "rayapp-train")


def with_app(train_fn, args: argparse.Namespace, namespace: str) -> int:
    """``train_fn(handle, args)`` against the app already running at ``args.address``, or against
    ``args.recipe``'s app on a local head started for the run and stopped after it (Ray's session
    folder ``args.temp_dir``, default ``/tmp/<namespace>-<pid>``)."""
    import ray

    from rayapp import connect

    if args.address:
        try:
            train_fn(connect(args.address, args.app, namespace=namespace, verbose=args.verbose), args)
        finally:
            ray.shutdown()
        return 0
    from rayapp.cli import LOCAL_ENV, local_app

    os.environ.update(LOCAL_ENV)
    temp_dir = Path(args.temp_dir or f"/tmp/{namespace}-{os.getpid()}")
    log = temp_dir.parent / f"{temp_dir.name}-serve.log"
    print(f"logs: {log} (ray start, serve run: Ray's, Serve's and the replicas' lines)"
          + ("; shown here too (--verbose)" if args.verbose else "; --verbose shows them here"), flush=True)
    with local_app(args.recipe, temp_dir, log, timeout_s=args.timeout, verbose=args.verbose) as (address, _):
        print(f"serve app running on {address}", flush=True)
        try:
            # the replicas' lines come through serve run's output (the log, or the terminal with --verbose)
            train_fn(connect(address, args.app, namespace=namespace, verbose=args.verbose, worker_logs=False),
                     args)
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
