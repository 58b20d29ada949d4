"""Step metrics: eval accuracy and pass@k per dataset, failure-class counts (docs/scheduler.md §5).

pass@k is the unbiased estimator of Chen et al. 2021 (the HumanEval paper): for a prompt with n
samples of which c pass, ``1 - C(n-c, k) / C(n, k)``, averaged over prompts. Aborted samples stay
in the counts as failures: dropping them would flatter the figures. "Passes" is ``is_solved``, the
same test the failure classes' ``success`` uses. A prompt is its group (``group_of``), not its task_id.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from math import comb, inf
from typing import Any

from rayapp.core.stats import sample_statistics
from rayapp.core.termination import FailureClass, classify_termination, is_solved
from rayapp.types import Sample, TaskKey


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n passes."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def is_correct(sample: Sample) -> bool:
    """Solved, as the failure classes say (``termination.is_solved``)."""
    return is_solved(sample.reward)


def group_of(sample: Sample) -> str:
    """The group a sample's pass@k pools it in: its ``TaskKey.GROUP_ID`` (an eval step gives a
    prompt's copies one), else its task_id for samples built by hand. Not the task_id first: two
    prompts sharing an id would pool as one prompt with twice the copies."""
    return str(sample.metadata.get(TaskKey.GROUP_ID.value, sample.task_id))


def eval_metrics(samples_by_dataset: dict[str, list[Sample]], n_copies: int) -> dict[str, float]:
    """``eval/{name}/accuracy`` for every dataset and, when n_copies > 1, ``eval/{name}/pass@k``
    for k = 1 and k = n_copies (and the powers of two between)."""
    metrics: dict[str, float] = {}
    ks = sorted({1, n_copies} | {2**i for i in range(1, n_copies.bit_length()) if 2**i < n_copies})
    for name, samples in samples_by_dataset.items():
        if not samples:
            continue
        metrics[f"eval/{name}/accuracy"] = sum(is_correct(s) for s in samples) / len(samples)
        metrics[f"eval/{name}/n_samples"] = float(len(samples))
        if n_copies > 1:
            groups: dict[str, list[Sample]] = defaultdict(list)
            for s in samples:
                groups[group_of(s)].append(s)
            for k in ks:
                scores = [pass_at_k(len(g), sum(is_correct(s) for s in g), k)
                          for g in groups.values() if len(g) >= k]
                if scores:
                    metrics[f"eval/{name}/pass@{k}"] = sum(scores) / len(scores)
    return metrics


def failure_summary(samples: Iterable[Sample]) -> dict[str, int]:
    """Count of samples per failure class (the eight of ``FailureClass``, zeros included)."""
    counts = Counter(
        classify_termination(s.reward, s.episode.reason).value for s in samples
    )
    return {fc.value: counts.get(fc.value, 0) for fc in FailureClass}


def outcome_metrics(prefix: str, samples: Iterable[Sample]) -> dict[str, float]:
    """``{prefix}/<failure class>`` counts and the per-dataset sample statistics of what a step
    returns: counted over the samples handed back, whichever step ran them (a partial rollout's
    carried group brings samples an earlier step ran)."""
    samples = list(samples)
    return {f"{prefix}/{k}": float(v) for k, v in failure_summary(samples).items()} | sample_statistics(prefix, samples)


def abort_digest(samples: Iterable[Sample]) -> dict[str, Any] | None:
    """How many of ``samples`` aborted, by reason, and the first abort by the evaluator's clock (its
    task, sample, phase, reason and error text): what a step says once, so that a fault every sample
    meets (a verifier that returns a float) reads as its error, not only as an abort count. None
    when none aborted."""
    aborted = [s for s in samples if s.episode.abort is not None]
    if not aborted:
        return None
    first = min(aborted, key=lambda s: s.episode.abort.window[-1] if s.episode.abort.window else inf)
    a = first.episode.abort
    return {"n_aborted": len(aborted), "by_reason": dict(Counter(s.episode.abort.reason.value for s in aborted)),
            "first": {"task_id": first.task_id, "index": first.index, "reason": a.reason.value,
                      "phase": str(a.phase), "error": a.error}}
