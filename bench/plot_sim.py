"""Plots of the simulator's rows (``bench/sim.py --plot DIR``, or this script on its ``--json``):

* ``perf_makespan.png``: makespan / lower bound per policy and workload, one panel per cluster size;
* ``perf_utilisation.png``: the share of reserved capacity that did work, same layout;
* ``perf_timeline.png``: GPUs held and GPUs working over virtual time, per policy, for the first
  workload on the first cluster size (when the run recorded them);
* ``perf_partial.png`` in place of those three when the run took several steps (``--steps 5``): the
  share of reserved capacity that did work per policy and workload, the 85% bar drawn in.

matplotlib (the ``bench`` extra), Agg backend: no display needed.

Run from the repo root: ``.venv/bin/python bench/plot_sim.py sim.json docs``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _panels(rows: list[dict], key: str, ylabel: str, path: Path, *, ref: float | None = None) -> Path:
    sizes = sorted({r["nodes"] for r in rows})
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    every = list(dict.fromkeys(r["policy"] for r in rows))  # one colour per policy in every plot
    policies = [p for p in every if any(r["policy"] == p and r.get(key) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(sizes), figsize=(max(6.5, 5.2 * len(sizes)), 4.2), sharey=True, squeeze=False)
    width = 0.8 / max(1, len(policies))
    for ax, nodes in zip(axes[0], sizes, strict=True):
        for j, policy in enumerate(policies):
            ys = []
            for w in workloads:
                r = next((x for x in rows if (x["nodes"], x["workload"], x["policy"]) == (nodes, w, policy)), None)
                ys.append(r.get(key) if r and r.get(key) is not None else float("nan"))
            ax.bar([i + (j - (len(policies) - 1) / 2) * width for i in range(len(workloads))], ys, width,
                   label=policy, color=f"C{every.index(policy)}")
        if ref is not None:
            ax.axhline(ref, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(workloads)), workloads)
        waves = next(r["waves"] for r in rows if r["nodes"] == nodes)
        ax.set_title(f"{nodes:,} nodes x 8 GPUs ({waves:g} waves)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    handles, labels = axes[0][0].get_legend_handles_labels()
    ncol = min(len(policies), 3 * len(sizes))  # a narrow figure takes its legend on several lines
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, 0.07 * -(-len(policies) // ncol), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _timeline(timelines: dict[str, list], title: str, path: Path) -> Path:
    fig, axes = plt.subplots(len(timelines), 1, figsize=(10, 2.4 * len(timelines)), sharex=True, squeeze=False)
    for ax, (name, points) in zip(axes[:, 0], timelines.items(), strict=True):
        t = [p[0] for p in points]
        ax.step(t, [p[1] for p in points], where="post", label="GPUs held by batches")
        ax.step(t, [p[2] for p in points], where="post", label="GPUs doing work")
        ax.set_title(name, fontsize=10)
        ax.set_ylabel("GPUs")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8, loc="upper right")
    axes[-1][0].set_xlabel(f"virtual seconds ({title})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: list[dict], timelines: dict[str, list], out: Path) -> list[Path]:
    """Write the PNGs into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    pct = [{**r, "reserved_busy": None if r.get("reserved_busy") is None else 100 * r["reserved_busy"]} for r in rows]
    if all(r["steps"] > 1 for r in rows):  # the partial-rollout run: work kept over several steps
        return [_panels(pct, "reserved_busy", f"% of reserved GPU time doing work ({rows[0]['steps']} steps)",
                        out / "perf_partial.png", ref=85.0)]
    paths = [
        _panels(rows, "ratio_lb", "makespan ÷ lower bound", out / "perf_makespan.png", ref=1.0),
        _panels(pct, "reserved_busy", "% of reserved GPU time doing work", out / "perf_utilisation.png"),
    ]
    if timelines:
        first = rows[0]
        paths.append(_timeline(timelines, f"{first['workload']}, {first['nodes']:,} nodes", out / "perf_timeline.png"))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: plot_sim.py SIM.json OUT_DIR")
    data = json.loads(Path(sys.argv[1]).read_text())
    for p in plot(data["rows"], data.get("timelines", {}), Path(sys.argv[2])):
        print(f"wrote {p}")
