"""A step's placement timeline: who held which node and GPU when, as a Chrome trace (open it in
https://ui.perfetto.dev or ``chrome://tracing``) and as a PNG.

Read from the samples alone (their episode's placement and timing, status and abort record). In the
trace:

- one process per node, one thread per GPU of it (``gpu 0``; ``cpu`` for tokens without GPUs),
  split into numbered lanes where samples share a GPU (fractional shares), so that events on one
  lane never overlap; each sample's ``run`` and ``verify`` are complete events named after the
  sample (``task#index``), with its status and reason in ``args``; an abort is an instant event;
- one process ``pool queue`` with each batch's admission wait (from asking the pool to its grant),
  named after the batch (the scheduler's label, e.g. ``rollout3/b0/math``) and its samples.

Times are the evaluator's loop clock, shifted so the step's first event is at 0. The PNG (with
matplotlib, the ``plot`` extra that ``make`` installs) draws the same lanes as bars, each labelled
with its sample's dataset (environment) and task (``bar_label``). Without matplotlib no PNG is
written, and the first step to find that out logs it once (``PLOT_MISSING``); the import is not
tried again.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rayapp.record import EpisodeTiming
from rayapp.steps.atomic_files import atomic_write
from rayapp.types import Sample, Status, TaskKey

QUEUE = "pool queue"
PLOT_MISSING = "no timeline PNG: matplotlib is not installed (pip install 'rayapp[plot]'); the trace is written"
log = logging.getLogger(__name__)
_pyplot: Any = None  # matplotlib.pyplot once imported; False once its import failed (said once, not retried)


def bar_label(s: Sample) -> str:
    """A sample's bar label: its dataset (eval or rollout), its environment (the evaluator that ran it,
    from its batch's label ``rollout3/b0/math``) when that differs, and ``task#index``."""
    dataset = s.metadata.get(TaskKey.EVAL_DATASET_NAME) or s.metadata.get(TaskKey.DATASET_NAME)
    t = s.episode.timing
    env = t.batch.rsplit("/", 1)[-1] if t is not None and t.batch else None
    where = f"{dataset} ({env})" if dataset and env and env != dataset else (dataset or env)
    return f"{where} {s.task_id}#{s.index}" if where else f"{s.task_id}#{s.index}"


def _lane_of(lanes: dict[tuple, list[float]], key: tuple, start: float, end: float) -> int:
    """The first lane of ``key`` free at ``start`` (lanes[key][i]: when lane i frees)."""
    ends = lanes.setdefault(key, [])
    for i, free_at in enumerate(ends):
        if free_at <= start:
            ends[i] = end
            return i
    ends.append(end)
    return len(ends) - 1


def _spans(s: Sample, t: EpisodeTiming | None) -> list[tuple[str, float, float]]:
    """A sample's phases as (name, start, end), from its timing ``t``."""
    if t is None:
        return []
    start, spans = t.started, []
    for phase, took in (("run", t.run_s), ("verify", t.verify_s)):
        if took is None:
            break
        spans.append((phase, start, start + took))
        start += took
    end = t.ended
    if end is not None and end > start and s.status in (Status.ABORTED, Status.PENDING):
        spans.append(("run" if not spans else "verify", start, end))  # the phase it was in when it ended
    return spans


def timeline_rows(samples: Iterable[Sample]) -> list[dict]:
    """One row per bar: ``{node, lane, name, label, phase, start, end, status, reason, abort}`` (lane:
    ``gpu 0/1``; ``label``: ``bar_label``; ``abort``: the bar an aborted sample ended in)."""
    rows, lanes, batches = [], {}, {}
    for s in sorted(samples, key=lambda s: s.episode.timing.started if s.episode.timing is not None else 0.0):
        t = s.episode.timing
        spans = _spans(s, t)
        reason = s.episode.reason
        name, reason = f"{s.task_id}#{s.index}", None if reason is None else str(reason)
        if t is not None and t.queued is not None and t.admitted is not None:
            batches.setdefault((t.batch, t.queued, t.admitted), []).append(name)
        if not spans:
            continue
        place = s.episode.placement
        node = (place.node if place is not None else None) or "ungated"
        gpu = f"gpu {','.join(map(str, place.gpu_ids))}" if place is not None and place.gpu_ids else "cpu"
        i = _lane_of(lanes, (node, gpu), spans[0][1], spans[-1][2])
        for phase, start, end in spans:
            rows.append({"node": node, "lane": f"{gpu}/{i}", "name": name, "label": bar_label(s), "phase": phase,
                         "start": start,
                         "end": end, "status": str(s.status), "reason": reason, "abort": False})
        rows[-1]["abort"] = s.status is Status.ABORTED  # where it ended
    queue_lanes: dict[tuple, list[float]] = {}
    for (batch, queued, admitted), names in batches.items():
        i = _lane_of(queue_lanes, (QUEUE,), queued, admitted)
        rows.append({"node": QUEUE, "lane": f"batch/{i}", "name": f"{batch or 'batch'}: {', '.join(names[:4])}"
                     + (f" +{len(names) - 4}" if len(names) > 4 else ""), "label": batch or "batch",
                     "phase": "admission wait",
                     "start": queued, "end": admitted, "status": "", "reason": None, "abort": False})
    return rows


def chrome_trace(samples: Iterable[Sample], label: str = "step") -> dict[str, Any]:
    """The Chrome trace-event JSON of a step's samples (module docstring)."""
    rows = timeline_rows(samples)
    t0 = min((r["start"] for r in rows), default=0.0)
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    events: list[dict[str, Any]] = []
    for r in rows:
        pid = pids.setdefault(r["node"], len(pids) + 1)
        tid = tids.setdefault((r["node"], r["lane"]), len(tids) + 1)
        args = {"status": r["status"], "reason": r["reason"]} if r["status"] else {}
        events.append({"name": r["name"], "cat": r["phase"], "ph": "X", "pid": pid, "tid": tid,
                       "ts": round((r["start"] - t0) * 1e6), "dur": round((r["end"] - r["start"]) * 1e6),
                       "args": {"phase": r["phase"], **args}})
        if r["abort"]:
            events.append({"name": f"abort {r['name']}", "cat": "abort", "ph": "i", "s": "t", "pid": pid,
                           "tid": tid, "ts": round((r["end"] - t0) * 1e6), "args": {"reason": r["reason"]}})
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": node}} for node, pid in pids.items()]
    meta += [{"name": "thread_name", "ph": "M", "pid": pids[node], "tid": tid, "args": {"name": lane}}
             for (node, lane), tid in tids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": {"label": label}}


COLOURS = {"run": "tab:blue", "verify": "tab:green", "admission wait": "tab:gray"}


def _plt() -> Any:
    """matplotlib's pyplot (Agg), or None without matplotlib: the first miss is logged, and the import
    is not tried again in this process."""
    global _pyplot
    if _pyplot is None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.warning(PLOT_MISSING)
            plt = False
        _pyplot = plt
    return _pyplot or None


def timeline_figure(samples: Iterable[Sample], title: str = "") -> Any:
    """The timeline as a matplotlib Figure (bars labelled with ``bar_label``); None without matplotlib."""
    plt = _plt()
    if plt is None:
        return None
    rows = timeline_rows(samples)
    t0 = min((r["start"] for r in rows), default=0.0)
    lanes = sorted({(r["node"] == QUEUE, r["node"], r["lane"]) for r in rows})
    y = {(node, lane): i for i, (_, node, lane) in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(11, max(2.0, 0.28 * len(lanes) + 1)))
    bars: dict[str, list] = defaultdict(list)
    labelled: set[tuple] = set()
    for r in rows:
        row = y[r["node"], r["lane"]]
        bars[r["phase"]].append((row, r["start"] - t0, r["end"] - r["start"]))
        if (r["label"], row) not in labelled:  # once per sample (its run bar), where its first bar starts
            labelled.add((r["label"], row))
            ax.text(r["start"] - t0, row, " " + r["label"], va="center", ha="left", fontsize=5, clip_on=True)
        if r["abort"]:
            ax.plot(r["end"] - t0, row, "x", color="tab:red", markersize=7)
    for phase, items in bars.items():
        for row, start, width in items:
            ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=COLOURS.get(phase, "tab:purple"),
                           edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(lanes)), [f"{node} {lane}" for _, node, lane in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the step's first event")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend([*handles, plt.Line2D([], [], marker="x", color="tab:red", linestyle="")],
              [*COLOURS, "abort"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or "placement timeline")
    fig.tight_layout()
    return fig


def plot_timeline(samples: Iterable[Sample], path: str | Path, title: str = "") -> Path | None:
    """The timeline as a PNG at ``path``; None (nothing written) without matplotlib."""
    fig = timeline_figure(samples, title)
    if fig is None:
        return None
    path = Path(path)
    fig.savefig(path, dpi=110)
    _pyplot.close(fig)
    return path


def write_timeline(samples: list[Sample], folder: str | Path, stem: str) -> dict[str, Path]:
    """``{folder}/{stem}.trace.json`` and, with matplotlib, ``{stem}.png``; the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    trace = json.dumps(chrome_trace(samples, stem)).encode()
    out = {"timeline": atomic_write(folder / f"{stem}.trace.json", lambda f: f.write(trace))}
    png = plot_timeline(samples, folder / f"{stem}.png", stem)
    if png is not None:
        out["timeline_png"] = png
    return out
