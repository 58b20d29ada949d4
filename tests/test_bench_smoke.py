"""bench/overhead.py, bench/kv_reuse.py and bench/gateway.py run (``--smoke``: seconds) and print their
figures. Speed is the benchmark's business; nothing here asserts on it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_overhead_benchmark_runs_in_smoke_mode_and_prints_each_shape_and_the_worst():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--smoke"], capture_output=True,
                         text=True, timeout=120, env=env, check=True).stdout
    for agent in ("no-op", "yields once"):
        for group in (1, 16):  # the smallest and the largest group
            assert re.search(rf"^{agent}\s+{group}\s+64\s+[\d,]+\s+[\d,]+\s+\d+\.\d\dx$", out, re.M), out
        worst = rf"^worst for {agent}: [\d,]+ samples/s \(groups of \d+, 64 samples a batch\)$"
        assert re.search(worst, out, re.M), out


def test_the_kv_reuse_benchmark_runs_in_smoke_mode_and_prints_each_turn_and_the_episode():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kv_reuse.py"), "--smoke"], capture_output=True,
                         text=True, timeout=120, env=env, check=True).stdout
    assert re.search(r"^\s+2\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+x$", out, re.M), out
    assert re.search(r"^episode: \d+ ms with reuse, \d+ ms without: [\d.]+x; last turn [\d.]+x$", out, re.M), out


def test_the_gateway_benchmark_runs_in_smoke_mode_and_prints_each_row_the_ratio_and_the_memory():
    """It starts a local Ray with Serve of its own (127.0.0.1, token auth) and stops it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gateway.py"), "--smoke"], capture_output=True,
                         text=True, timeout=600, env=env, check=True).stdout
    for row in ("serve floor", "gateway, instant", "gateway, hf"):
        assert re.search(rf"^{row}\s+(-?[\d.]+\s+){{5}}[\d.]+$", out, re.M), out
    assert re.search(r"^gateway \(instant engine\) calls/s / serve floor: [\d.]+ \(target >= 0.80: (met|MISSED)\)$",
                     out, re.M), out
    assert re.search(r"^memory per open episode after one call: [\d.]+ KiB$", out, re.M), out
