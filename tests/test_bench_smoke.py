"""bench/overhead.py runs (``--smoke``: seconds) and prints both rates and their ratio. Speed is the
benchmark's business; nothing here asserts on it."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_overhead_benchmark_runs_in_smoke_mode_and_prints_the_ratio():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "overhead.py"), "--smoke"], capture_output=True,
                         text=True, timeout=120, env=env, check=True).stdout
    for agent in ("no-op", "yields once"):
        assert re.search(rf"^{agent}\s+[\d,]+\s+[\d,]+\s+\d+\.\d\dx$", out, re.M), out
