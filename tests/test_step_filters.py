"""Survivorship filters: the spec's order and why it matters, exact drop counts by filter and reason,
conservation of every sample, and the aborted-share cap's one warning."""

import copy
import logging

import msgspec
import pytest
from conftest import ended
from hypothesis import given
from hypothesis import strategies as st

from rayapp.steps.filters import (
    AbortCap,
    DropReason,
    FilterReport,
    FinishOnlyFilter,
    RejectionFilter,
    Verdict,
    apply_filters,
)
from rayapp.types import Sample, Status

SPEC_ORDER = [RejectionFilter(), FinishOnlyFilter()]


def make(kind: str, score: float = 0.0, task: str = "t", index: int = 0) -> Sample:
    """kind: ok (finished on its own), trunc (a limit stopped it), abort (a dummy), limit (COMPLETED
    but stopped by max_turns), pending (never ran), removed (remove_sample on a finished sample)."""
    status, reason, remove = {
        "ok": (Status.COMPLETED, "stop", False),
        "trunc": (Status.TRUNCATED, "max_turns", False),
        "abort": (Status.ABORTED, "infra_conn", True),
        "limit": (Status.COMPLETED, "max_turns", False),
        "pending": (Status.PENDING, None, False),
        "removed": (Status.COMPLETED, "stop", True),
    }[kind]
    reward = {} if kind == "pending" else {"score": score}
    return Sample(task_id=task, index=index, prompt="p", status=status, reward=reward,
                  episode=ended(reason), remove_sample=remove)


def group(task: str, *specs: tuple[str, float]) -> list[Sample]:
    return [make(kind, score, task, i) for i, (kind, score) in enumerate(specs)]


def ids(groups):
    return [[(s.task_id, s.index) for s in g] for g in groups]


def step():
    return [
        group("g0", ("ok", 1), ("ok", 1), ("ok", 1), ("ok", 1)),  # all correct
        group("g1", ("ok", 0), ("ok", 0), ("ok", 0), ("ok", 0)),  # all wrong
        group("g2", ("ok", 0), ("ok", 0), ("ok", 0), ("abort", 0)),  # all wrong, one of them an abort
        group("g3", ("ok", 1), ("ok", 0), ("trunc", 1), ("abort", 0)),  # signal; two unfinished
        group("g4", ("ok", 1), ("ok", 0), ("ok", 0), ("ok", 1)),  # signal; all finished
        group("g5", ("trunc", 1), ("abort", 0), ("limit", 0), ("pending", 0)),  # signal; none finished
    ]


def test_composition_order_matters():
    # Two successes and an abort: rejection sees scores 1, 1, 0 (signal) and keeps the group, then
    # finish-only removes the abort. The other way round the two survivors are all correct.
    g = group("g", ("ok", 1), ("ok", 1), ("abort", 0))
    spec = apply_filters([g], SPEC_ORDER)
    assert ids(spec.groups) == [[("g", 0), ("g", 1)]]
    assert spec.dropped == {"rejection": {}, "finish_only": {"aborted": 1}}

    reverse = apply_filters([g], SPEC_ORDER[::-1])
    assert reverse.groups == []
    assert reverse.dropped == {"finish_only": {"aborted": 1}, "rejection": {"all_correct": 2}}
    assert reverse.dropped_groups == {"finish_only": {}, "rejection": {"all_correct": 1}}


def test_counts_are_exact_per_sample():
    report = apply_filters(step(), SPEC_ORDER)
    assert ids(report.groups) == [[("g3", 0), ("g3", 1)], [("g4", i) for i in range(4)]]
    assert report.dropped == {
        "rejection": {"all_correct": 4, "all_wrong": 8},  # samples: g0; g1 and g2 (its abort included)
        "finish_only": {"truncated": 2, "aborted": 2, "not_stopped": 1, "pending": 1},
    }
    # g5 lost every sample, so the group is gone too, counted under its most severe reason
    assert report.dropped_groups == {"rejection": {"all_correct": 1, "all_wrong": 2}, "finish_only": {"aborted": 1}}
    assert (report.input_groups, report.input_samples, report.kept_samples) == (6, 24, 6)
    assert [(d.filter, d.reason, d.sample.task_id, d.sample.index) for d in report.drops][-6:] == [
        ("finish_only", "truncated", "g3", 2), ("finish_only", "aborted", "g3", 3),
        ("finish_only", "truncated", "g5", 0), ("finish_only", "aborted", "g5", 1),
        ("finish_only", "not_stopped", "g5", 2), ("finish_only", "pending", "g5", 3),
    ]
    assert report.summary()["kept_groups"] == 2


def test_finish_only_whole_group():
    report = apply_filters(step(), [RejectionFilter(), FinishOnlyFilter(whole_group=True)])
    assert ids(report.groups) == [[("g4", i) for i in range(4)]]
    assert report.dropped["finish_only"] == {"truncated": 2, "aborted": 2, "with_group": 2, "not_stopped": 1,
                                             "pending": 1}
    assert report.dropped_groups["finish_only"] == {"aborted": 2}


def test_finish_only_reasons_and_stop_reasons():
    g = group("g", ("removed", 1), ("limit", 0), ("ok", 1))
    assert apply_filters([g], [FinishOnlyFilter()]).dropped == {"finish_only": {"removed": 1, "not_stopped": 1}}
    lenient = apply_filters([g], [FinishOnlyFilter(stop_reasons=frozenset({"stop", "max_turns"}))])
    assert lenient.dropped == {"finish_only": {"removed": 1}} and lenient.kept_samples == 2


def test_rejection_options():
    all_right, all_wrong = group("a", ("ok", 1), ("ok", 1)), group("b", ("ok", 0), ("ok", 0))
    near = group("c", ("ok", 1), ("ok", 0.9), ("ok", 1), ("ok", 1))  # pstdev 0.0433
    keep_right = apply_filters([all_right, all_wrong], [RejectionFilter(drop_all_correct=False)])
    assert ids(keep_right.groups) == ids([all_right]) and keep_right.dropped == {"rejection": {"all_wrong": 2}}
    keep_wrong = apply_filters([all_right, all_wrong], [RejectionFilter(drop_all_wrong=False)])
    assert ids(keep_wrong.groups) == ids([all_wrong])
    assert apply_filters([near], [RejectionFilter()]).kept_samples == 4
    low = apply_filters([near], [RejectionFilter(min_score_std=0.1)])
    assert low.groups == [] and low.dropped_groups == {"rejection": {"low_std": 1}}
    other_key = group("d", ("ok", 1), ("ok", 1))
    other_key[0].reward["pass"] = 1.0  # "pass" 1 vs missing (0): signal under that key
    assert apply_filters([other_key], [RejectionFilter(key="pass")]).kept_samples == 2


def test_empty_groups_and_inputs_are_untouched():
    steps = step()
    before = copy.deepcopy(steps)
    report = apply_filters([[], *steps, []], SPEC_ORDER)
    assert report.dropped_groups["input"] == {"empty": 2}
    assert steps == before  # neither the lists nor the samples were changed
    assert apply_filters([], SPEC_ORDER).groups == []


kinds = st.sampled_from(["ok", "trunc", "abort", "limit", "pending", "removed"])
steps_st = st.lists(st.lists(st.tuples(kinds, st.sampled_from([0.0, 0.5, 1.0])), max_size=5), max_size=8)
filter_lists = st.lists(
    st.sampled_from([RejectionFilter(), RejectionFilter(drop_all_correct=False), RejectionFilter(min_score_std=0.3),
                     FinishOnlyFilter(), FinishOnlyFilter(whole_group=True)]),
    max_size=2,
    unique_by=lambda f: f.name,
)


@given(steps_st, filter_lists)
def test_nothing_is_lost_silently(spec, filters):
    groups = [group(f"g{i}", *g) for i, g in enumerate(spec)]
    report = apply_filters(groups, filters)
    kept = [id(s) for g in report.groups for s in g]
    dropped = [id(d.sample) for d in report.drops]
    assert sorted(kept + dropped) == sorted(id(s) for g in groups for s in g)  # each sample exactly once
    assert len(kept) + sum(n for per in report.dropped.values() for n in per.values()) == report.input_samples
    removed_groups = sum(n for per in report.dropped_groups.values() for n in per.values())
    assert len(report.groups) + removed_groups == report.input_groups == len(groups)
    assert all(report.groups)  # no empty group is handed to the trainer


def test_abort_cap_warns_once_and_drops_nothing(caplog):
    groups = [group("a", ("abort", 0), ("abort", 0), ("ok", 1)), group("b", ("abort", 0), ("ok", 0))]
    groups[1][0].episode = ended("agent_timeout")
    with caplog.at_level(logging.WARNING, logger="rayapp.steps.filters"):
        report = apply_filters(groups, [], abort_cap=AbortCap(max_aborted_share=0.5), rollout_id=7)
    assert report.abort_share_exceeded and report.aborted == 3 and report.abort_share == 0.6
    assert ids(report.groups) == ids(groups)  # measured and reported, nothing dropped
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    for part in ("rollout 7", "3 of 5 samples (60.0%)", "cap of 50.0%", "infra_conn=2", "agent_timeout=1"):
        assert part in message, part


def test_abort_cap_measures_the_step_before_filters(caplog):
    groups = [group("a", ("abort", 0), ("ok", 1)), group("b", ("ok", 1), ("ok", 0))]
    with caplog.at_level(logging.WARNING, logger="rayapp.steps.filters"):
        at_cap = apply_filters(groups, SPEC_ORDER, abort_cap=AbortCap(0.25))
        no_cap = apply_filters(groups, SPEC_ORDER)
    assert at_cap.abort_share == 0.25 and not at_cap.abort_share_exceeded  # equal to the cap is within it
    assert no_cap.aborted == 0 and not no_cap.abort_share_exceeded
    assert not caplog.records
    assert at_cap.dropped["finish_only"] == {"aborted": 1}


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan"), "half"])
def test_bad_abort_cap(share):
    with pytest.raises(ValueError, match="max_aborted_share"):
        AbortCap(share)


def test_bad_filter_lists_and_plugins():
    with pytest.raises(ValueError, match="unique"):
        apply_filters(step(), [RejectionFilter(), RejectionFilter(min_score_std=0.2)])
    with pytest.raises(ValueError, match="min_score_std"):
        RejectionFilter(min_score_std=-1)

    class Lossy:
        name = "lossy"

        def judge(self, group):
            return Verdict(kept=group[1:])  # loses the first sample without a word

    with pytest.raises(RuntimeError, match=r"'lossy'.*exactly once"):
        apply_filters(step(), [Lossy()])

    class Vague:
        name = "vague"

        def judge(self, group):
            return Verdict(kept=[], dropped=[(s, "meh") for s in group], group_reason="meh")

    with pytest.raises(ValueError, match=r"'vague' gave drop reason 'meh'"):
        apply_filters(step(), [Vague()])


def test_verdicts_hold_drop_reasons_and_the_summary_plain_strings():
    report = apply_filters(step(), SPEC_ORDER)
    assert report.drops and all(type(d.reason) is DropReason for d in report.drops)
    assert all(type(r) is DropReason for per in report.dropped.values() for r in per)
    summary = report.summary()
    assert all(type(r) is str for per in summary["dropped"].values() for r in per)
    assert summary["dropped"] == report.dropped  # the same counts


def test_stop_reasons_are_termination_reasons_checked_when_parsed():
    parsed = msgspec.convert({"stop_reasons": ["stop", "length"]}, FinishOnlyFilter)
    assert parsed.stop_reasons == {"stop", "length"}
    with pytest.raises(msgspec.ValidationError, match=r"max_context.*\$\.stop_reasons\[0\]"):
        msgspec.convert({"stop_reasons": ["max_context"]}, FinishOnlyFilter)  # a failure class, not a reason


def test_report_defaults_are_independent():
    a, b = FilterReport(), FilterReport()
    a.dropped["x"] = {"y": 1}
    assert b.dropped == {}


@pytest.mark.parametrize(("score", "reason"), [(1.0, DropReason.ALL_CORRECT), (0.5, DropReason.ALL_WRONG),
                                               (0.0, DropReason.ALL_WRONG)])
def test_rejection_calls_a_group_correct_exactly_when_the_failure_classes_call_its_samples_successes(score, reason):
    from rayapp.core.termination import FailureClass, classify_termination

    group = [make("ok", score, index=i) for i in range(3)]
    verdict = RejectionFilter().judge(group)
    assert verdict.group_reason is reason
    success = {classify_termination(s.reward, s.episode.reason) for s in group}
    assert (reason is DropReason.ALL_CORRECT) == (success == {FailureClass.SUCCESS})
    # keeping all-correct groups keeps an all-0.5 group only if it is not called correct
    assert (RejectionFilter(drop_all_correct=False).judge(group).group_reason is None) == (score == 1.0)
