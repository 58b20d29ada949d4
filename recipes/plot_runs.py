"""Held-out accuracy of several GRPO runs on one plot (the ``history.json`` files recipes/train_grpo.py
writes), e.g. the native calculator agent against the example OpenAI agent through the gateway:

    python recipes/plot_runs.py native=/tmp/grpo-native/history.json gateway=/tmp/grpo-gateway/history.json \\
        -o docs/training_gateway.png

A run given several histories (``LABEL=PATH,PATH,...``, e.g. one per seed) is their mean at the steps
all of them evaluated. Per run: the arithmetic problems' greedy held-out accuracy per step (solid, with
a band of one standard error: the binomial noise of 64 problems, of the mean over its histories) and
the word problems' (dashed). Needs matplotlib (the ``plot`` extra). It also prints the accuracies per
step (each history's too) and the differences between the first run and each other one, in standard
errors.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def load(spec: str) -> tuple[str, list[dict]]:
    """A run: its label and its evaluations, the mean of its histories' at the steps all of them have
    (``se``: the standard error of that mean; ``each``: every history's arithmetic accuracy)."""
    label, sep, paths = spec.partition("=")
    if not sep or not label or not paths:
        raise SystemExit(f"run {spec!r}: expected LABEL=PATH/history.json[,PATH/history.json...]")
    histories = []
    for path in paths.split(","):
        try:
            rows = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"run {label}: cannot read {path}: {e}") from None
        evals = {r["step"]: r for r in rows if "acc_arithmetic" in r}
        if not evals:
            raise SystemExit(f"run {label}: {path} holds no held-out evaluation (no 'acc_arithmetic' row)")
        histories.append(evals)
    steps = sorted(set.intersection(*(set(h) for h in histories)))
    out = []
    for step in steps:
        rows = [h[step] for h in histories]
        k = len(rows)
        out.append({"step": step, "acc_arithmetic": sum(r["acc_arithmetic"] for r in rows) / k,
                    "acc_word": sum(r["acc_word"] for r in rows) / k,
                    "se": math.sqrt(sum(stderr(r["acc_arithmetic"], n_arithmetic(r)) ** 2 for r in rows)) / k,
                    "each": [r["acc_arithmetic"] for r in rows]})
    return label, out


def stderr(p: float, n: float) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1.0))


def n_arithmetic(row: dict) -> float:
    # the math env's problems alternate arithmetic and word (rayapp/envs/math.py): half are arithmetic
    return row.get("eval_samples", 128.0) / 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="LABEL=PATH of a run's history.json")
    p.add_argument("-o", "--out", default="docs/training_gateway.png")
    p.add_argument("--title", default="GRPO on the tiny model (CPU): native agent vs the OpenAI agent via the gateway")
    args = p.parse_args(argv)
    runs = [load(spec) for spec in args.runs]
    base_label, base = runs[0]
    for label, evals in runs:
        cells = []
        for r in evals:
            cell = f"step {r['step']}: {r['acc_arithmetic']:.3f} (word {r['acc_word']:.3f})"
            if len(r["each"]) > 1:
                cell += " = mean of " + "/".join(f"{a:.3f}" for a in r["each"])
            twin = next((b for b in base if b["step"] == r["step"]), None)
            if twin is not None and label != base_label:
                se = math.hypot(r["se"], twin["se"])
                cell += f" [{(r['acc_arithmetic'] - twin['acc_arithmetic']) / se:+.1f} se vs {base_label}]"
            cells.append(cell)
        print(f"{label}: held-out arithmetic accuracy " + "; ".join(cells))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, evals), color in zip(runs, ["tab:blue", "tab:orange", "tab:green", "tab:red"] * 4, strict=False):
        steps = [r["step"] for r in evals]
        acc = [r["acc_arithmetic"] for r in evals]
        se = [r["se"] for r in evals]
        ax.plot(steps, acc, "o-", color=color, label=f"{label}: arithmetic")
        ax.fill_between(steps, [a - s for a, s in zip(acc, se, strict=True)],
                        [a + s for a, s in zip(acc, se, strict=True)], color=color, alpha=0.15)
        ax.plot(steps, [r["acc_word"] for r in evals], "s--", color=color, alpha=0.6, label=f"{label}: word problems")
    ax.set_xlabel("GRPO step (weights version)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(args.title, fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    plt.close(fig)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
