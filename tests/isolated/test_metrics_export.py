"""rayapp's counters on Ray's metrics endpoint, in a Ray of its own (its metrics reported every
second): every counter's series exists at 0 before any event, and a step's seconds are counted
exactly beside the histogram, whose ``_sum`` Ray makes of bucket midpoints."""

import os
import sys
import time
import urllib.request

import pytest

os.environ["RAY_metrics_report_interval_ms"] = "1000"  # noqa: SIM112 (Ray's own name): set before Ray starts
ray = pytest.importorskip("ray")

from rayapp.actors.engine import EngineClient  # noqa: E402
from rayapp.cli.local_cluster import auth_token  # noqa: E402
from rayapp.types import StepKind  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DATASETS = {StepKind.ROLLOUT: ["arith"], StepKind.EVAL: ["held_out"]}


@ray.remote(num_cpus=0)
class Recorder:
    """Records as the manager replica does: the series at 0 at start, then one 33.2 s rollout step."""

    def __init__(self) -> None:
        from rayapp.actors.prometheus import RayappMetrics

        self.metrics = RayappMetrics()
        self.metrics.zero(DATASETS, ["policy"], EngineClient.METHODS)

    def step(self, seconds: float) -> None:
        self.metrics.step(StepKind.ROLLOUT, {"rollout/time/step_s": seconds})


@pytest.fixture(scope="module")
def port():
    with auth_token():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning", log_to_driver=False)
        yield ray.nodes()[0]["MetricsExportPort"]
        ray.shutdown()


def scrape(port: int, until: str, timeout_s: float = 60.0) -> dict[str, float]:
    """rayapp's series by name{its own tags}, once a series named ``until`` is there."""
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("ray_rayapp_"):
                name, value = line.rsplit(" ", 1)
                series, _, tags = name.partition("{")
                own = sorted(t for t in tags.rstrip("}").split(",")
                             if t.split("=")[0] in {"kind", "dataset", "status", "reason", "engine", "method",
                                                    "error", "phase"})
                out[f"{series}{{{','.join(own)}}}"] = float(value)
        if any(k.startswith(until) for k in out) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def test_every_counter_at_zero_from_the_start_and_step_seconds_exact(port):
    recorder = Recorder.remote()
    before = scrape(port, "ray_rayapp_engine_errors_total")
    counters = ("samples_total", "aborts_total", "response_tokens_total", "steps_total",
                "filter_dropped_samples_total", "engine_errors_total", "step_seconds_total",
                "admission_wait_seconds_total", "episode_phase_seconds_total", "engine_request_seconds_total")
    for name in counters:
        series = {k: v for k, v in before.items() if k.startswith(f"ray_rayapp_{name}{{")}
        assert series and set(series.values()) == {0.0}, (name, sorted(before))
    for kind, (dataset,) in DATASETS.items():
        for status in ("completed", "truncated", "aborted"):
            assert before[f'ray_rayapp_samples_total{{dataset="{dataset}",kind="{kind}",status="{status}"}}'] == 0
        assert before[f'ray_rayapp_aborts_total{{dataset="{dataset}",kind="{kind}",reason="agent_timeout"}}'] == 0
    assert before['ray_rayapp_engine_errors_total{engine="policy",error="AgentTimeout",method="generate"}'] == 0

    ray.get(recorder.step.remote(33.2), timeout=60)
    after = scrape(port, 'ray_rayapp_step_seconds_count{kind="rollout"}')
    assert after['ray_rayapp_steps_total{kind="rollout"}'] == 1
    assert after['ray_rayapp_step_seconds_total{kind="rollout"}'] == pytest.approx(33.2, abs=1e-9)
    # the histogram's own sum is its bucket's midpoint (30-60 s): why the exact counter exists
    assert after['ray_rayapp_step_seconds_sum{kind="rollout"}'] == 45.0
