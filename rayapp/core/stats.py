"""Step statistics a trainer logs as they are (``wandb.log(metrics)``, a tensorboard writer): flat
keys ``{prefix}/{name}/{stat}``, one ``name`` per dataset (the sample's ``_eval_dataset_name`` or
``_dataset_name``; ``default`` when it came from a plain data source).

Per name: ``n_samples``; ``reward_{mean,std,min,max}`` of the ``score`` and
``response_length_{mean,std,min,max}``, both over the samples that did not abort (an aborted
dummy's score 0 and length 1 say nothing of the policy); ``truncated_rate`` and ``abort_rate``
over all of them; and from each sample's own timing (``Sample.episode.timing``), the mean and
max of ``wait_s`` (its batch's admission wait), ``run_s``, ``verify_s`` and ``episode_s`` (start to
end, teardown included). A statistic with no sample to take it from is left out, never faked as 0.
``step_times`` adds the step's own: ``time/step_s``, ``time/fetch_s`` and ``samples_per_s``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from rayapp.core.clock import loop_time
from rayapp.record import AbortReason
from rayapp.types import Sample, Status, StepKind, TaskKey

DEFAULT_NAME = "default"


_EVAL_NAME, _DATASET_NAME = TaskKey.EVAL_DATASET_NAME.value, TaskKey.DATASET_NAME.value


def name_of(sample: Sample) -> str:
    m = sample.metadata
    return str(m.get(_EVAL_NAME) or m.get(_DATASET_NAME) or DEFAULT_NAME)


def _spread(key: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {f"{key}_mean": mean, f"{key}_std": std, f"{key}_min": min(values), f"{key}_max": max(values)}


def _mean_max(key: str, values: list[float]) -> dict[str, float]:
    return {f"{key}_mean": sum(values) / len(values), f"{key}_max": max(values)} if values else {}


def step_times(prefix: str, n_samples: int, began: float, fetched: float) -> dict[str, float]:
    """How long the step took (``time/step_s``), its fetch (``time/fetch_s``), samples per second."""
    took = loop_time() - began
    return {f"{prefix}/time/step_s": took, f"{prefix}/time/fetch_s": fetched - began,
            f"{prefix}/samples_per_s": n_samples / took if took > 0 else 0.0}


TIMING_KEYS = ("wait_s", "run_s", "verify_s", "episode_s")
_NO_TIMING = (None, None, None, None)


def durations(sample: Sample) -> tuple[float | None, float | None, float | None, float | None]:
    """``sample``'s timing as ``TIMING_KEYS`` name them: its batch's admission wait, run, verify and
    start to end; None where it has no such figure."""
    t = sample.episode.timing
    if t is None:
        return _NO_TIMING
    return (t.admitted - t.queued if t.admitted is not None and t.queued is not None else None,
            t.run_s, t.verify_s, t.ended - t.started if t.ended is not None else None)


def timings(sample: Sample) -> dict[str, float]:
    """The durations ``sample``'s timing gives, by name (``TIMING_KEYS``), those it has."""
    return {k: x for k, x in zip(TIMING_KEYS, durations(sample), strict=True) if x is not None}


def sample_statistics(prefix: str, samples: Iterable[Sample]) -> dict[str, float]:
    """The per-dataset statistics of ``samples`` (module docstring), keyed ``{prefix}/{name}/...``."""
    # One pass and no object per sample: a step may hold tens of thousands of them.
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # samples, aborted, truncated
    by_name: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        name = name_of(s)
        c, v = counts[name], by_name[name]
        c[0] += 1
        if s.status is Status.ABORTED:
            c[1] += 1
        else:
            if s.status is Status.TRUNCATED:
                c[2] += 1
            if "score" in s.reward:
                v["reward"].append(float(s.reward["score"]))
            v["response_length"].append(float(s.response_length))
        for key, x in zip(TIMING_KEYS, durations(s), strict=True):
            if x is not None:
                v[key].append(x)
    metrics: dict[str, float] = {}
    for name, (n, aborted, truncated) in counts.items():
        v = by_name[name]
        stats = {"n_samples": float(n), "truncated_rate": truncated / n, "abort_rate": aborted / n}
        stats |= _spread("reward", v["reward"]) | _spread("response_length", v["response_length"])
        for key in TIMING_KEYS:
            stats |= _mean_max(key, v[key])
        metrics |= {f"{prefix}/{name}/{k}": x for k, x in stats.items()}
    return metrics


Observation = tuple[str, float, dict[str, str]]  # (metric, value, tags): a counter's increment or a histogram's value


def observations(kind: StepKind, samples: Iterable[Sample]) -> list[Observation]:
    """What a metrics exporter records of finished samples: per sample ``samples_total`` (tags kind,
    dataset, status), ``aborts_total`` (with the abort's reason), ``response_tokens_total``, and from
    its timing ``admission_wait_seconds`` and ``episode_phase_seconds`` (phase run or verify)."""
    out: list[Observation] = []
    for s in samples:
        tags = {"kind": kind.value, "dataset": name_of(s)}
        out.append(("samples_total", 1.0, {**tags, "status": str(s.status)}))
        if s.status is Status.ABORTED:
            reason = str(s.episode.reason or "unknown")
            out.append(("aborts_total", 1.0, {**tags, "reason": reason}))
        elif s.response_length:
            out.append(("response_tokens_total", float(s.response_length), tags))
        t = timings(s)
        if "wait_s" in t:
            out.append(("admission_wait_seconds", t["wait_s"], tags))
        for phase in ("run", "verify"):
            if f"{phase}_s" in t:
                out.append(("episode_phase_seconds", t[f"{phase}_s"], {**tags, "phase": phase}))
    return out


FINAL_STATUSES = (Status.COMPLETED, Status.TRUNCATED, Status.ABORTED)


def zero_observations(datasets: dict[StepKind, Iterable[str]]) -> list[Observation]:
    """The counters' series ``observations`` can increment, at 0, for ``datasets`` (dataset names by
    step kind): an exporter makes them exist from the start, so a dashboard reads 0, not "no data",
    until the first sample, abort or token is counted."""
    out: list[Observation] = []
    for kind, names in datasets.items():
        for name in names:
            tags = {"kind": kind.value, "dataset": name}
            out += [("samples_total", 0.0, {**tags, "status": str(s)}) for s in FINAL_STATUSES]
            out += [("aborts_total", 0.0, {**tags, "reason": str(r)}) for r in AbortReason]
            out.append(("response_tokens_total", 0.0, tags))
    return out
