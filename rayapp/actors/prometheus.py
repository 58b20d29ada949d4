"""rayapp's Prometheus metrics, through ``ray.util.metrics`` (so Ray's metrics endpoint on each
node exports them, ``ray_rayapp_*``, beside Ray's and Serve's own).

What the manager records (names below, without Ray's ``ray_`` prefix):

- per finished sample (``core.stats.observations``): ``rayapp_samples_total{kind,dataset,status}``,
  ``rayapp_aborts_total{kind,dataset,reason}``, ``rayapp_response_tokens_total{kind,dataset}``,
  ``rayapp_admission_wait_seconds{kind,dataset}`` and ``rayapp_episode_phase_seconds{kind,dataset,
  phase}`` (histograms);
- per step run: ``rayapp_steps_total{kind}``, ``rayapp_step_seconds{kind}``,
  ``rayapp_filter_dropped_samples_total``;
- every ``POLL_S`` while steps run: ``rayapp_batches{state=waiting|running}`` and the pool's
  ``rayapp_pool_resource{node,resource=gpu|cpu|memory_gb,state=capacity|free|held}``;
- per engine call: ``rayapp_engine_request_seconds{engine,method}`` and
  ``rayapp_engine_errors_total{engine,method,error}``.

Every counter's series for the recipe's datasets and engines exists at 0 from the replica's start
(``RayappMetrics.zero``). Ray exports a histogram's ``_sum`` from its buckets' midpoints, not from the
values observed (a 33.2 s step adds 45.0, the middle of the 30-60 s bucket): each histogram of
seconds has an exact counter beside it, ``<histogram>_total`` (``rayapp_step_seconds_total``, ...).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from rayapp.core.stats import observations, zero_observations
from rayapp.core.termination import AgentTimeout, EngineConnectionError
from rayapp.types import Sample, StepKind

log = logging.getLogger(__name__)

POLL_S = 10.0  # the pool's placement() reads its groups' states from the GCS: not too often
SECONDS = [0.005, 0.02, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600]
_SAMPLE_TAGS = ("kind", "dataset")


class Seconds:
    """A histogram of durations and the exact total of what it observed: Ray's ``_sum`` of a
    histogram is made of bucket midpoints, so the total is counted apart."""

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]) -> None:
        self.histogram = Histogram(name, description, SECONDS, tag_keys=tag_keys)
        self.total = Counter(f"{name}_total", f"{description}: the exact sum of the seconds observed",
                             tag_keys=tag_keys)

    def observe(self, seconds: float, tags: dict[str, str]) -> None:
        self.histogram.observe(seconds, tags)
        if seconds > 0:  # Counter.inc refuses 0, and adding 0 changes nothing
            self.total.inc(seconds, tags)


def at_zero(counter: Counter, tags: dict[str, str]) -> None:
    """Make ``counter``'s series for ``tags`` exist, at 0. ``Counter.inc`` refuses 0 (nothing public
    makes a series before its first event); the record it makes after that check is taken as is:
    Ray's exporter adds the value to the series' total, creating it."""
    counter._record(0.0, tags)


class RayappMetrics:
    """The metric objects of one process (create it in the replica that records)."""

    def __init__(self) -> None:
        self.counters = {
            "samples_total": Counter("rayapp_samples_total", "samples finished, by status",
                                     tag_keys=(*_SAMPLE_TAGS, "status")),
            "aborts_total": Counter("rayapp_aborts_total", "aborted samples, by reason",
                                    tag_keys=(*_SAMPLE_TAGS, "reason")),
            "response_tokens_total": Counter("rayapp_response_tokens_total", "response tokens of the samples that "
                                             "did not abort", tag_keys=_SAMPLE_TAGS),
        }
        self.histograms = {
            "admission_wait_seconds": Seconds("rayapp_admission_wait_seconds", "a sample's batch: from asking "
                                              "the pool to its grant", _SAMPLE_TAGS),
            "episode_phase_seconds": Seconds("rayapp_episode_phase_seconds", "an episode's run or verify phase",
                                             (*_SAMPLE_TAGS, "phase")),
        }
        self.steps = Counter("rayapp_steps_total", "steps run", tag_keys=("kind",))
        self.step_seconds = Seconds("rayapp_step_seconds", "a step's wall time", ("kind",))
        self.dropped = Counter("rayapp_filter_dropped_samples_total", "samples the survivorship filters dropped")
        self.batches = Gauge("rayapp_batches", "batches of the step in flight", tag_keys=("state",))
        self.pool = Gauge("rayapp_pool_resource", "the placement pool per node", tag_keys=("node", "resource", "state"))
        self.engine_seconds = Seconds("rayapp_engine_request_seconds", "engine calls", ("engine", "method"))
        self.engine_errors = Counter("rayapp_engine_errors_total", "engine calls that failed",
                                     tag_keys=("engine", "method", "error"))

    def zero(self, datasets: dict[StepKind, Iterable[str]], engines: Iterable[str], methods: Iterable[str]) -> None:
        """Every counter's series that the recipe's ``datasets`` (names by step kind), ``engines`` and
        their ``methods`` can take, at 0; an engine error of another class than the client's own two
        (a timeout, a lost engine) starts its series when it first happens."""
        for name, _, tags in zero_observations(datasets):
            at_zero(self.counters[name], tags)
        for kind, names in datasets.items():
            at_zero(self.step_seconds.total, {"kind": kind.value})
            for name in names:
                tags = {"kind": kind.value, "dataset": name}
                at_zero(self.histograms["admission_wait_seconds"].total, tags)
                for phase in ("run", "verify"):
                    at_zero(self.histograms["episode_phase_seconds"].total, {**tags, "phase": phase})
        for kind in StepKind:
            at_zero(self.steps, {"kind": kind.value})
        at_zero(self.dropped, {})
        for engine in engines:
            for method in methods:
                at_zero(self.engine_seconds.total, {"engine": engine, "method": method})
                for error in (AgentTimeout, EngineConnectionError):
                    at_zero(self.engine_errors, {"engine": engine, "method": method, "error": error.__name__})

    def samples(self, kind: StepKind, samples: list[Sample]) -> None:
        for name, value, tags in observations(kind, samples):
            if name in self.counters:
                self.counters[name].inc(value, tags)
            else:
                self.histograms[name].observe(value, tags)

    def step(self, kind: StepKind, metrics: dict[str, float]) -> None:
        self.steps.inc(1.0, {"kind": kind.value})
        took = metrics.get(f"{kind}/time/step_s")
        if took is not None:
            self.step_seconds.observe(took, {"kind": kind.value})
        dropped = metrics.get("filter/input_samples", 0.0) - metrics.get("filter/kept_samples", 0.0)
        if "filter/kept_samples" in metrics and dropped > 0:
            self.dropped.inc(dropped)

    def engine_call(self, engine: str, method: str, seconds: float, error: BaseException | None) -> None:
        self.engine_seconds.observe(seconds, {"engine": engine, "method": method})
        if error is not None:
            self.engine_errors.inc(1.0, {"engine": engine, "method": method, "error": type(error).__name__})

    def status(self, status: dict[str, Any]) -> None:
        self.batches.set(status.get("batches_waiting", 0), {"state": "waiting"})
        self.batches.set(status.get("batches_running", 0), {"state": "running"})

    def placement(self, placement: dict[str, Any]) -> None:
        """The pool's per-node capacity, free and held resources, from its ``placement()``."""
        for node, group in placement.get("groups", {}).items():
            capacity = {"gpu": 0.0, "cpu": 0.0, "memory_gb": 0.0}
            for b in group.get("bundles", []):
                capacity["gpu"] += float(b.get("GPU", 0.0))
                capacity["cpu"] += float(b.get("CPU", 0.0))
                capacity["memory_gb"] += float(b.get("memory", 0.0)) / 2**30
            free = placement.get("free", {}).get(node, {})
            free_of = {r: float(free.get(r, 0.0)) for r in capacity}  # a lost or cordoned node has none
            for r, cap in capacity.items():
                tags = {"node": node, "resource": r}
                self.pool.set(cap, {**tags, "state": "capacity"})
                self.pool.set(free_of[r], {**tags, "state": "free"})
                self.pool.set(max(0.0, cap - free_of[r]), {**tags, "state": "held"})


async def poll(metrics: RayappMetrics, status: Callable[[], dict[str, Any]],
               placement: Callable[[], Awaitable[dict[str, Any]]] | None, every_s: float = POLL_S) -> None:
    """Refresh the gauges every ``every_s`` until cancelled; a failed read is logged and retried."""
    while True:
        try:
            metrics.status(status())
            if placement is not None:
                metrics.placement(await asyncio.wait_for(placement(), every_s * 4))
        except Exception as e:
            log.warning("metrics: could not read the pool or the step's status: %s: %s", type(e).__name__, e)
        await asyncio.sleep(every_s)
