"""The simulator (bench/sim.py) in smoke mode: what it reports means what it says. Semantics only:
every sample comes back exactly once, the pool ends as it started, the lower bound is a lower
bound, and the per-sample list schedule is never slower than holding each batch to its end."""

import importlib
import sys
from collections import Counter
from pathlib import Path

import pytest

from rayapp.types import Sample, Status

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sim = importlib.import_module("sim")
sim_peers = importlib.import_module("sim_peers")
sim_policies = importlib.import_module("sim_policies")
sim_workloads = importlib.import_module("sim_workloads")

EPS = 1e-9  # virtual time sums the same floats in another order


@pytest.mark.parametrize("workload", list(sim_workloads.WORKLOADS))
def test_every_policy_returns_every_sample_once_and_no_makespan_beats_the_bounds(workload):
    rows, runs = sim.simulate(workload, 2, seed=3, steps=2, waves=2.0)
    core = [r for r in runs if r.release != "step_end"]
    assert {r.policy for r in core} == {p.name for p in sim_policies.POLICIES if sim_policies.supported(p)}
    for r in core:
        assert r.returned_once, r.policy
        assert r.pool_restored, r.policy
        assert 0 < r.work_gpu_s <= r.held_gpu_s * (1 + EPS), r.policy  # nothing worked without a token
    assert all(r.samples == 2 * 16 * 8 for r in runs)
    lb, list_makespan = rows[0]["lb"], rows[0]["list"]
    # Partial rollouts carry groups into later steps, so the per-step bound (summed) does not bound
    # them; the bound of the whole run as one step does (total demand, the longest episode).
    carries = {p.name for p in sim_policies.POLICIES if p.partial}
    traces = [sim_workloads.workload(workload, rows[0]["tasks"], 3, step=s) for s in range(2)]
    whole = sim_peers.lower_bound([[t for step in traces for t in step]], 2)
    assert whole <= lb * (1 + EPS)
    for row in rows:
        if row["makespan"] is not None:
            assert row["makespan"] >= (whole if row["policy"] in carries else lb) * (1 - EPS), row["policy"]
    hold = next(r for r in rows if r["policy"] == "hold FIFO")
    assert hold["release"] == "batch_end"
    assert list_makespan <= hold["makespan"] * (1 + EPS)


def test_the_list_schedule_and_lower_bound_on_a_hand_case():
    # One node holds 32 samples; 40 samples of 10 s: 32 run at once, the last 8 start at 10 s.
    sample = sim_workloads.SampleTrace(((9.0, 0.0),), 1.0)
    tasks = [sim_workloads.TaskTrace(f"t{i}", (sample,) * 8, 10.0) for i in range(5)]
    assert sim_peers.list_schedule([tasks], 1) == 20.0
    assert sim_peers.lower_bound([tasks], 1) == max(40 * 10 * 0.25 / 8, 10.0)
    assert sim_peers.lower_bound([tasks, tasks], 1) == 2 * 12.5


def test_the_exactly_once_check_catches_a_lost_repeated_or_failed_sample():
    tasks = sim_workloads.workload("lognormal", 2, seed=0)
    want = Counter((t.task_id, i) for t in tasks for i in range(8))
    done = [Sample(tid, i, "", status=Status.COMPLETED) for tid, i in want]
    check = sim_policies.check_returned_once
    assert check([tasks], [[done]], want)
    assert not check([tasks], [[done[1:]]], want)  # one lost
    assert not check([tasks], [[done + done[:1]]], want)  # one returned twice
    assert not check([tasks], [[done]], want + Counter([next(iter(want))]))  # one ran twice
    aborted = [Sample(s.task_id, s.index, "", status=Status.ABORTED) for s in done[:1]]
    assert not check([tasks], [[aborted + done[1:]]], want)
