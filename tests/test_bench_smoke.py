"""bench/overhead.py, bench/kv_reuse.py and bench/gateway_flood.py run (``--smoke``: seconds) and print
their figures, and bench/replica_memory.py judges a run's table. Speed is the benchmark's business; nothing
here asserts on it. (bench/gateway.py starts a Ray cluster and Serve of its own: minutes even in --smoke,
so `make bench` runs it, not `make test`.)"""

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



def test_the_gateway_flood_benchmark_runs_in_smoke_mode_and_prints_both_phases():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gateway_flood.py"), "--smoke"], capture_output=True,
                         text=True, timeout=300, env=env, check=True).stdout
    assert re.search(r"answers \{'200': \d+, '401': \d+, '413': \d+\}$", out, re.M), out  # a round or more
    for phase in ("quiet", "flood"):
        for what in ("loop lag", "cheap call"):
            figures = rf"^{phase}\s+{what}\s+p50\s+[\d.]+ ms\s+p99\s+[\d.]+ ms\s+max\s+[\d.]+ ms"
            assert re.search(figures, out, re.M), out
    assert re.search(r"^flood took [\d.]+ s; peak RSS \d+ MB before, \d+ MB after$", out, re.M), out

def _memory_table(path: Path, manager_mb_per_step: float) -> None:
    """A run's --csv of 200 steps: the pool flat, the manager rising by ``manager_mb_per_step`` with a
    saw-tooth of +-1 MB on top (glibc giving memory back now and then)."""
    rows = ["step,kind,seconds,manager_rss,manager_anon,pool_rss,pool_anon"]
    for step in range(1, 201):
        manager = 600 + manager_mb_per_step * step + (1.0 if step % 7 < 3 else -1.0)
        rows.append(f"{step},rollout,10.0,{manager:.3f},{manager - 250:.3f},265.0,125.0")
    path.write_text("\n".join(rows) + "\n")


def test_the_replica_memory_benchmark_judges_a_run_by_its_late_slope(tmp_path):
    """bench/replica_memory.py --analyse: the table again and the verdict (the run itself starts the
    Serve app: minutes, not run here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for per_step, verdict in ((0.0, r"^verdict: PLATEAU"), (0.1, r"^verdict: GROWTH \(manager_rss \+0\.1\d*, "
                                                                   r"manager_anon \+0\.1\d*\)")):
        table = tmp_path / f"run-{per_step}.csv"
        _memory_table(table, per_step)
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "replica_memory.py"), "--analyse", str(table)],
                             capture_output=True, text=True, timeout=120, env=env, check=True).stdout
        assert re.search(r"^\s+200 rollout\s+10\.0(\s+[\d.]+){4}$", out, re.M), out
        assert re.search(r"^manager_rss\s+[-\d.]+\s+[-\d.]+$", out, re.M), out
        assert re.search(verdict, out, re.M), out
