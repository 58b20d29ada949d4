import pytest
from conftest import ended

from rayapp.core.step_metrics import eval_metrics, failure_summary, pass_at_k
from rayapp.types import Sample


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (4, 1, 1, 0.25),            # c/n
    (4, 2, 2, 1 - 1 / 6),       # 1 - C(2,2)/C(4,2)
    (5, 1, 2, 1 - 6 / 10),      # 1 - C(4,2)/C(5,2)
    (10, 3, 5, 1 - 21 / 252),   # 1 - C(7,5)/C(10,5)
    (3, 2, 2, 1.0),             # n - c < k
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 4, 1), (3, 1, 0), (3, 1, 4), (3, -1, 1)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def s(task, score, reason="stop"):
    return Sample(task, 0, "p", reward={"score": score}, episode=ended(reason))


def test_eval_metrics_per_dataset_with_pass_at_k():
    by_name = {
        "a": [s("a0", 1), s("a0", 0), s("a0", 0), s("a0", 0), s("a1", 0), s("a1", 0), s("a1", 0), s("a1", 0)],
        "b": [s("b0", 1), s("b0", 1), s("b0", 1), s("b0", 1)],
        "empty": [],
    }
    m = eval_metrics(by_name, n_copies=4)
    assert m["eval/a/accuracy"] == pytest.approx(1 / 8)
    assert m["eval/a/pass@1"] == pytest.approx((0.25 + 0) / 2)
    assert m["eval/a/pass@2"] == pytest.approx((0.5 + 0) / 2)    # 1 - C(3,2)/C(4,2) = 0.5
    assert m["eval/a/pass@4"] == pytest.approx((1.0 + 0) / 2)
    assert m["eval/b/accuracy"] == m["eval/b/pass@4"] == 1.0
    assert not any(k.startswith("eval/empty/") for k in m)


def test_eval_metrics_single_copy_reports_accuracy_only():
    m = eval_metrics({"a": [s("a0", 1), s("a1", 0)]}, n_copies=1)
    assert m == {"eval/a/accuracy": 0.5, "eval/a/n_samples": 2.0}


def test_failure_summary_counts_every_class():
    summary = failure_summary([s("a", 1), s("b", 0), s("c", 0, "max_turns"), s("d", 0, "infra_conn")])
    assert len(summary) == 8
    assert summary["success"] == summary["wrong_answer"] == summary["max_turns"] == summary["infra_conn"] == 1
    assert sum(summary.values()) == 4


@pytest.mark.parametrize("score", [-1.0, 0.0, 0.25, 0.999, 1.0, 1.5])
def test_accuracy_pass_at_k_and_the_failure_classes_agree_on_what_is_solved(score):
    samples = [s("a0", score), s("a0", score)]
    m = eval_metrics({"a": samples}, n_copies=2)
    solved = failure_summary(samples)["success"] == 2
    assert m["eval/a/accuracy"] == m["eval/a/pass@1"] == m["eval/a/pass@2"] == (1.0 if solved else 0.0)
    assert solved == (score >= 1.0)
