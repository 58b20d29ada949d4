"""Survivorship filters over a rollout step's groups (docs/scheduler.md §5), and the aborted-share cap.

A step is ``list[list[Sample]]``: one group per prompt, GRPO style. Filters compose as a list and
run in list order; the spec's order is rejection first, finish-only on the survivors::

    report = apply_filters(groups, [RejectionFilter(), FinishOnlyFilter()], abort_cap=AbortCap(0.5))

The order matters: rejection judges each group as it was sampled (aborted dummies included, with
their score of 0), so a group of two successes and one abort carries signal and survives it; the
finish-only filter then removes the abort. Run the other way round, the two successes would be an
all-correct group and be rejected.

Guarantees of ``apply_filters``:

- Nothing is lost silently: every input sample ends up either in ``report.groups`` or in
  ``report.drops`` with the filter and reason that removed it, so kept + dropped == input, for
  samples (``dropped``) and for groups (``dropped_groups``). A filter that breaks this (a plugin
  that invents or loses samples) is a RuntimeError, not a quietly smaller batch.
- Groups and samples keep their order; the input lists and samples are never mutated.
- The abort cap only measures and warns (one ``logging`` warning per step); it drops nothing.
"""

from __future__ import annotations

import enum
import logging
import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import msgspec
from msgspec import Meta

from rayapp.core.termination import is_solved
from rayapp.record import TerminationReason
from rayapp.types import Sample, Status

log = logging.getLogger(__name__)

Group = list[Sample]
_NAME = Meta(description="the filter's name in drop counts and filter/<name>/... metrics")
# TerminationReason's values as a type, so that a recipe naming another reason is refused when parsed
# (a Literal rather than the enum: the values stay plain strings in recipes and the knob reference)
ReasonValue = Literal[tuple(r.value for r in TerminationReason)]  # type: ignore[valid-type]


class DropReason(enum.StrEnum):
    # rejection: the group's scores are all equal, so its advantages are all zero (no signal)
    ALL_CORRECT = "all_correct"  # ... and solved (core.termination.is_solved: what the failure classes call success)
    ALL_WRONG = "all_wrong"  # ... and not solved (a partial score such as 0.5 included)
    LOW_STD = "low_std"  # not all equal, but the std is under RejectionFilter.min_score_std
    # finish-only: the sample did not finish on its own; most severe first (a group removed
    # whole is counted under the most severe reason among its samples)
    ABORTED = "aborted"  # an aborted dummy (status ABORTED)
    REMOVED = "removed"  # remove_sample set on a sample that is not an abort
    TRUNCATED = "truncated"  # stopped by a limit: max_turns, max_context_len, a length cut
    PENDING = "pending"  # never ran
    NOT_STOPPED = "not_stopped"  # COMPLETED, but its termination reason is not a stop reason
    WITH_GROUP = "with_group"  # finished, but dropped with its group (FinishOnlyFilter(whole_group=True))
    # a group only: empty in the input, or emptied by a filter that gave no group_reason
    EMPTY = "empty"


_SEVERITY = list(DropReason)  # finish-only's reasons, most severe first


class Verdict(msgspec.Struct):
    """One filter's decision on one group. ``kept`` + the samples of ``dropped`` must be the
    group's samples exactly. When ``kept`` is empty the group is gone and ``group_reason`` says why."""

    kept: list[Sample]
    dropped: list[tuple[Sample, DropReason]] = []
    group_reason: DropReason | None = None


class Filter(Protocol):
    """What ``apply_filters`` calls; a plugin filter needs only these two members."""

    name: str

    def judge(self, group: Group) -> Verdict: ...


class Drop(msgspec.Struct, frozen=True):
    filter: str
    reason: DropReason
    sample: Sample


def score(sample: Sample, key: str = "score") -> float:
    # A sample without the key scored nothing (classify_termination reads it the same way).
    return float(sample.reward.get(key, 0.0))


class RejectionFilter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Drops whole groups that carry no learning signal: every reward equal (all-same rejection),
    or a reward std under ``min_score_std``. ``drop_all_correct=False`` keeps all-equal solved
    groups (for SFT on successes, say); ``drop_all_wrong=False`` keeps all-equal unsolved ones. Solved
    means what the failure classes mean by success (``core.termination.is_solved``).

    A one-sample group is all-same by definition: use this filter with groups of n_samples > 1."""

    min_score_std: Annotated[float, Meta(description="also drop groups whose reward std (population) is under "
                                                     "this; 0: only all-equal groups")] = 0.0
    drop_all_correct: Annotated[bool, Meta(description="drop groups whose rewards are all equal and solved (>= "
                                                       "1, the failure classes' success)")] = True
    drop_all_wrong: Annotated[bool, Meta(description="drop groups whose rewards are all equal and not solved (< 1, "
                                                     "a partial score included)")] = True
    key: Annotated[str, Meta(description="the reward key judged (a sample without it scores 0)")] = "score"
    name: Annotated[str, _NAME] = "rejection"

    def __post_init__(self) -> None:
        if not isinstance(self.min_score_std, int | float) or not self.min_score_std >= 0:
            raise ValueError(f"RejectionFilter.min_score_std must be a number >= 0, got {self.min_score_std!r}")

    def judge(self, group: Group) -> Verdict:
        scores = [score(s, self.key) for s in group]
        reason: DropReason | None = None
        if len(set(scores)) == 1:
            if is_solved(scores[0]):  # the one meaning of success, as the failure classes count it
                reason = DropReason.ALL_CORRECT if self.drop_all_correct else None
            else:
                reason = DropReason.ALL_WRONG if self.drop_all_wrong else None
        elif statistics.pstdev(scores) < self.min_score_std:
            reason = DropReason.LOW_STD
        if reason is None:
            return Verdict(kept=list(group))
        return Verdict(kept=[], dropped=[(s, reason) for s in group], group_reason=reason)


class FinishOnlyFilter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Keeps samples that finished on their own: status COMPLETED, ``remove_sample`` unset, and a
    termination reason (``Sample.episode.termination_reason``) in ``stop_reasons``.

    Per sample by default: a group shrinks to its finished samples, and disappears only when none
    is left. ``whole_group=True`` drops a group with any unfinished sample entirely, for trainers
    that need every group at full size; its finished samples are counted as ``with_group``."""

    whole_group: Annotated[bool, Meta(description="drop a group whole when any of its samples did not finish; "
                                                  "false: only those samples")] = False
    stop_reasons: Annotated[frozenset[ReasonValue], Meta(description="the agent termination reasons that count as "
                                                                     "finished")] = (
        frozenset({TerminationReason.STOP.value}))
    name: Annotated[str, _NAME] = "finish_only"

    def reason(self, sample: Sample) -> DropReason | None:
        """Why ``sample`` did not finish on its own, or None when it did."""
        if sample.status is Status.ABORTED:
            return DropReason.ABORTED
        if sample.remove_sample:
            return DropReason.REMOVED
        if sample.status is Status.TRUNCATED:
            return DropReason.TRUNCATED
        if sample.status is not Status.COMPLETED:
            return DropReason.PENDING
        if sample.episode.reason not in self.stop_reasons:
            return DropReason.NOT_STOPPED
        return None

    def judge(self, group: Group) -> Verdict:
        reasons = [self.reason(s) for s in group]
        bad = [r for r in reasons if r is not None]
        if not bad:
            return Verdict(kept=list(group))
        worst = min(bad, key=_SEVERITY.index)
        if self.whole_group:
            dropped = [(s, r or DropReason.WITH_GROUP) for s, r in zip(group, reasons, strict=True)]
            return Verdict(kept=[], dropped=dropped, group_reason=worst)
        kept = [s for s, r in zip(group, reasons, strict=True) if r is None]
        dropped = [(s, r) for s, r in zip(group, reasons, strict=True) if r is not None]
        return Verdict(kept=kept, dropped=dropped, group_reason=None if kept else worst)


class AbortCap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A cap on the share of aborted dummies in one step. Above it, the step is still trained on
    (dummies carry zero gradient), but a run of mostly infrastructure failures should be loud."""

    max_aborted_share: Annotated[float, Meta(description="fraction of a step's samples, in [0, 1], that may be "
                                                         "aborted before a warning is logged")] = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.max_aborted_share, int | float) or not 0.0 <= self.max_aborted_share <= 1.0:
            raise ValueError(f"AbortCap.max_aborted_share must be a number in [0, 1], got {self.max_aborted_share!r}")


class FilterReport(msgspec.Struct):
    """The survivors and the account of everything else. ``dropped`` counts samples and
    ``dropped_groups`` counts groups removed whole, both by filter name and reason."""

    groups: list[Group] = []
    drops: list[Drop] = []
    dropped: dict[str, dict[DropReason, int]] = {}
    dropped_groups: dict[str, dict[DropReason, int]] = {}
    input_groups: int = 0
    input_samples: int = 0
    aborted: int = 0
    abort_share: float = 0.0
    abort_share_exceeded: bool = False

    @property
    def kept_samples(self) -> int:
        return sum(len(g) for g in self.groups)

    def summary(self) -> dict:
        """Counts only (no samples): for logs, metrics and summary.json."""
        return {
            "input_groups": self.input_groups, "input_samples": self.input_samples,
            "kept_groups": len(self.groups), "kept_samples": self.kept_samples,
            "dropped": msgspec.to_builtins(self.dropped), "dropped_groups": msgspec.to_builtins(self.dropped_groups),
            "aborted": self.aborted, "abort_share": self.abort_share,
            "abort_share_exceeded": self.abort_share_exceeded,
        }


def apply_filters(
    groups: Sequence[Sequence[Sample]],
    filters: Sequence[Filter],
    *,
    abort_cap: AbortCap | None = None,
    rollout_id: int | None = None,
) -> FilterReport:
    """Run ``filters`` in order over ``groups`` (each filter sees only the previous one's
    survivors) and account for every drop. An empty input group is removed and counted under
    ``dropped_groups["input"]["empty"]``. ``rollout_id`` only labels the abort-cap warning.
    Drop reasons are ``DropReason``s; a plugin filter's plain string is made one here, so a reason
    outside the enum is a ValueError naming the filter."""
    names = [f.name for f in filters]
    if len(set(names)) != len(names):
        raise ValueError(f"filter names must be unique (their counts would merge), got {names}")
    report = FilterReport(input_groups=len(groups), input_samples=sum(len(g) for g in groups))
    if abort_cap is not None:
        _check_abort_share(report, groups, abort_cap, rollout_id)
    current = [list(g) for g in groups if g]
    if len(current) < len(groups):
        report.dropped_groups["input"] = {DropReason.EMPTY: len(groups) - len(current)}
    for f in filters:
        samples, groups_ = Counter(), Counter()
        survivors = []
        for group in current:
            verdict = f.judge(group)
            _check_verdict(f.name, group, verdict)
            for sample, reason in verdict.dropped:
                samples[_reason(f.name, reason)] += 1
                report.drops.append(Drop(f.name, _reason(f.name, reason), sample))
            if verdict.kept:
                survivors.append(verdict.kept)
            else:
                groups_[_reason(f.name, verdict.group_reason or DropReason.EMPTY)] += 1
        report.dropped[f.name] = dict(samples)
        report.dropped_groups[f.name] = dict(groups_)
        current = survivors
    report.groups = current
    return report


def _reason(name: str, reason: DropReason | str) -> DropReason:
    try:
        return DropReason(reason)
    except ValueError:
        raise ValueError(f"filter {name!r} gave drop reason {reason!r}, not one of "
                         f"{[r.value for r in DropReason]}") from None


def _check_verdict(name: str, group: Group, verdict: Verdict) -> None:
    # Identity, not equality: two equal samples must not stand in for one another.
    seen = [id(s) for s in verdict.kept] + [id(s) for s, _ in verdict.dropped]
    if sorted(seen) != sorted(id(s) for s in group):
        raise RuntimeError(f"filter {name!r} returned {len(verdict.kept)} kept + {len(verdict.dropped)} dropped "
                           f"samples for a group of {len(group)}: every sample must be kept or dropped exactly once")


def _check_abort_share(report: FilterReport, groups: Sequence[Sequence[Sample]], cap: AbortCap,
                       rollout_id: int | None) -> None:
    # Measured on the step as sampled: after finish-only no abort would be left to count.
    aborted = [s for g in groups for s in g if s.status is Status.ABORTED]
    report.aborted = len(aborted)
    report.abort_share = len(aborted) / report.input_samples if report.input_samples else 0.0
    if report.abort_share <= cap.max_aborted_share:
        return
    report.abort_share_exceeded = True
    causes = Counter(str(s.episode.reason or "unknown") for s in aborted)
    step = "rollout step" if rollout_id is None else f"rollout {rollout_id}"
    log.warning(
        "%s: %d of %d samples (%.1f%%) are aborted dummies, above the cap of %.1f%% (AbortCap.max_aborted_share); "
        "they train with zero gradient, so this step learns from few samples. Causes: %s. Check the inference "
        "engines and sandboxes.",
        step, len(aborted), report.input_samples, 100 * report.abort_share, 100 * cap.max_aborted_share,
        ", ".join(f"{k}={v}" for k, v in causes.most_common()),
    )
