"""The Grafana dashboard shipped in cluster/ queries only metrics rayapp exports (by their name on
Ray's endpoint: Ray prefixes ``ray_``; histograms add ``_bucket``)."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_grafana_dashboard_queries_what_rayapp_exports():
    pytest.importorskip("ray")
    from rayapp.actors.prometheus import RayappMetrics

    m = RayappMetrics()
    seconds = [*m.histograms.values(), m.step_seconds, m.engine_seconds]
    objects = [*m.counters.values(), m.steps, m.dropped, m.batches, m.pool, m.engine_errors,
               *(s.histogram for s in seconds), *(s.total for s in seconds)]
    exported = {f"ray_{o._name}" for o in objects}
    exported |= {f"{name}_bucket" for name in exported}
    dash = json.loads((ROOT / "cluster" / "grafana-rayapp.json").read_text())
    queried = {name for p in dash["panels"] for t in p["targets"]
               for name in re.findall(r"\bray_rayapp_[a-z_]+", t["expr"])}
    assert queried and queried <= exported, queried - exported
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
