"""The staleness bound's bookkeeping (``core.staleness``), without a stream: its capacity is AReaL's
(η + v + 1)·B - (accepted + running), and admission plus hand-over by ``may_take`` never leave a
group past its deadline, whatever order groups finish in."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.core.staleness import StalenessBound


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), batch=st.integers(1, 5), eta=st.integers(0, 3), steps=st.integers(1, 30))
def test_no_group_is_ever_taken_past_its_deadline_and_capacity_is_areals(seed, batch, eta, steps):
    rng = random.Random(seed)
    bound = StalenessBound(batch, eta)
    running, finished, admitted = [], [], 0  # deadlines
    while bound.version < steps:
        # AReaL's count, with accepted + running = every group admitted (none is rejected here)
        assert bound.capacity() == max(0, (eta + bound.version + 1) * batch - admitted)
        for _ in range(rng.randint(0 if running or finished else 1, bound.capacity())):
            running.append(bound.admit())
            admitted += 1
        rng.shuffle(running)  # groups finish in any order
        finished += [running.pop() for _ in range(rng.randint(0 if finished else 1, len(running)))] if running else []
        finished.sort()  # earliest deadline first, as the stream hands over
        while finished and bound.may_take(finished[0]):
            deadline = finished.pop(0)
            assert deadline >= bound.version  # never overdue
            bound.take(deadline)
        if bound.left == 0:
            bound.advance(bound.version + 1, drained=False)
        # the lines: what must be taken by version w fits the slots left up to w
        for w in range(bound.version, bound.version + eta + 1):
            due = sum(d <= w for d in running + finished)
            assert due <= bound.left + (w - bound.version) * batch


def test_a_group_due_later_waits_while_an_earlier_one_runs_and_the_slots_are_spoken_for():
    """B = 1, η = 1. Taking groups as they finish (AReaL's count alone) lets a straggler fall
    behind by more than η; here the newer group is refused until the straggler is taken."""
    bound = StalenessBound(1, 1)
    straggler, quick = bound.admit(), bound.admit()  # both at version 0, due by 1
    bound.take(quick)
    bound.advance(1, drained=False)
    newer = bound.admit()  # due by 2
    assert not bound.may_take(newer)  # the one slot of version 1 is the straggler's
    assert bound.may_take(straggler)
    bound.take(straggler)
    bound.advance(2, drained=False)
    assert bound.may_take(newer)


def test_publishing_early_or_out_of_order_is_refused():
    bound = StalenessBound(2, 1)
    bound.take(bound.admit())
    with pytest.raises(ValueError, match="took 1 of the 2 groups of version 0"):
        bound.advance(1, drained=False)
    bound.advance(1, drained=True)  # nothing more will come: a short last batch is fine
    with pytest.raises(ValueError, match="publish 2 next"):
        bound.advance(3, drained=True)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        StalenessBound(0, 1)
