"""The placement timeline: a step's samples as a Chrome trace (one process per node, a thread per
GPU lane, the pool queue's admission waits) and a PNG; lanes never hold overlapping events."""

import asyncio
import json
import sys
from collections import defaultdict
from itertools import pairwise

import pytest

from rayapp.core.agent import FunctionAgent
from rayapp.core.clock import run_virtual
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.steps import timeline as timeline_module
from rayapp.steps.artifacts import EvalDetailsWriter
from rayapp.steps.timeline import PLOT_MISSING, QUEUE, chrome_trace, plot_timeline, timeline_figure, timeline_rows
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Status, Task, TaskConfig

TWO_NODES = '{"n0": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}, "n1": {"gpus": [0], "cpu": 8, "memory_gb": 64}}'


class Tasks:
    async def get_tasks(self, n):
        return [Task(f"t{i}", "p", TaskConfig("x", n_samples=3)) for i in range(n)]


async def run_fn(sample, ctx):
    await asyncio.sleep(5 + 7 * sample.index + int(sample.task_id[1:]))
    if sample.index == 2 and sample.task_id == "t1":
        raise ConnectionError("engine gone")
    return AgentResult(tokens=[1, 2], response_length=1)


async def verify_fn(sample, result):
    await asyncio.sleep(2)
    return {"score": 1.0}


@pytest.fixture
def step(make_pool):
    spec = EvaluatorSpec("x", FunctionAgent(run_fn, verify_fn), batch_size=1,
                         resource=Resource(gpu=1.5, concurrency=3), run_resource=Resource(gpu=0.5))
    sched = TaskScheduler([spec], Tasks(), make_pool(TWO_NODES), SchedulerConfig(rollout_batch_size=5,
                                                                                  progress=False))
    return [s for g in run_virtual(sched.execute_rollout(0)).groups for s in g]


def test_the_trace_has_a_lane_per_gpu_share_and_nothing_overlaps_on_a_lane(step):
    trace = chrome_trace(step, "train_0")
    json.dumps(trace)  # plain JSON
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert set(names.values()) == {"n0", "n1", QUEUE}
    spans = [e for e in events if e["ph"] == "X"]
    work = [e for e in spans if e["cat"] in ("run", "verify")]
    # every sample's run, and a verify for every one that did not abort
    assert len([e for e in work if e["cat"] == "run"]) == 15
    assert len([e for e in work if e["cat"] == "verify"]) == 14
    aborts = [e for e in events if e["ph"] == "i"]
    assert [e["name"] for e in aborts] == ["abort t1#2"] and aborts[0]["args"]["reason"] == "infra_conn"
    by_lane = defaultdict(list)
    for e in work:
        by_lane[e["pid"], e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for lane in by_lane.values():  # a lane is one slot of one GPU: its events follow one another
        lane.sort()
        assert all(a[1] <= b[0] or a[2] == b[2] for a, b in pairwise(lane))
    waits = [e for e in spans if e["cat"] == "admission wait"]
    assert len(waits) == 5 and min(e["ts"] for e in spans) == 0  # a wait per batch; time from the first event
    # three GPUs, each shared by two samples at 0.5: six lanes of work
    assert len(by_lane) == 6


def test_rows_put_a_sample_where_its_token_was(step):
    for r in timeline_rows(step):
        if r["node"] == QUEUE:
            continue
        s = next(s for s in step if f"{s.task_id}#{s.index}" == r["name"])
        assert r["node"] == trainer_metadata(s)["_placement"]["node"]
        assert r["lane"].startswith(f"gpu {trainer_metadata(s)['_placement']['gpu_ids'][0]}/")
        assert r["abort"] == (s.status is Status.ABORTED and r["phase"] == "run")


def test_the_writer_puts_the_trace_and_png_beside_eval_details(step, tmp_path):
    paths = EvalDetailsWriter(tmp_path).write_timeline("train", 0, step)
    assert paths["timeline"] == tmp_path / "timeline" / "train_0.trace.json"
    assert json.loads(paths["timeline"].read_text())["otherData"] == {"label": "train_0"}
    # matplotlib is in the 'plot' extra that `make demo` and `make test` install: the PNG is always there
    assert paths["timeline_png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_png_bars_name_the_dataset_the_env_and_the_task(step):
    for s in step:
        s.metadata["_eval_dataset_name"] = f"set-{s.task_id}"
    fig = timeline_figure(step, "eval_0")
    labels = {t.get_text().strip() for t in fig.axes[0].texts}
    # every sample's bar: its dataset, the env that ran it (the batch label's evaluator, "x"), task#index
    assert {f"set-{s.task_id} (x) {s.task_id}#{s.index}" for s in step} <= labels
    assert any(label.startswith("rollout0/b") for label in labels)  # the pool queue's bars: their batch


def test_without_matplotlib_the_run_says_so_once_and_writes_the_trace(step, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(timeline_module, "_pyplot", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with caplog.at_level("WARNING", logger=timeline_module.__name__):
        assert plot_timeline(step, tmp_path / "a.png") is None
        paths = EvalDetailsWriter(tmp_path).write_timeline("train", 1, step)
    assert set(paths) == {"timeline"} and paths["timeline"].exists() and not (tmp_path / "a.png").exists()
    assert [r.getMessage() for r in caplog.records] == [PLOT_MISSING]
