"""bench/overhead.py and bench/kv_reuse.py run (``--smoke``: seconds) and print their figures. Speed is the
benchmark's business; nothing here asserts on it."""

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
