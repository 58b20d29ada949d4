"""bench/gpu_sglang.py runs here as far as it can without a GPU: `--help` (no sglang needed), the
no-GPU exit, and bad sizes rejected before anything starts. Its GPU path is not run here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "gpu_sglang.py"


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def test_help_needs_no_sglang():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert "--model" in r.stdout and "--num-prompts" in r.stdout
    assert "sglang" not in sys.modules  # nor did the test process import it


def test_no_gpu_exits_2_with_one_clear_line():
    r = _run("--num-prompts", "4", env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "needs a GPU machine" in r.stderr and "nothing was run" in r.stderr
    assert r.stdout == ""


def test_bad_size_is_rejected_naming_the_flag():
    r = _run("--output-len", "0")
    assert r.returncode == 2 and "--output-len must be >= 1, got 0" in r.stderr


def test_the_sglang_benchmark_it_calls_takes_those_flags():
    """The module and flags run_sglang passes exist in the sglang the constraints pin (its source,
    when a .venv-sglang sits beside this checkout; skipped otherwise)."""
    import re

    import pytest

    found = sorted(ROOT.parent.glob("*/.venv-sglang/lib/python3*/site-packages/sglang/benchmark/offline_throughput.py"))
    if not found:
        pytest.skip("no .venv-sglang beside this checkout")
    bench_src = found[0].read_text()
    # ServerArgs' flags are "--" + field name with "-" for "_", from the dataclass fields in these files
    fields = "".join(f.read_text() for f in (found[0].parents[1] / "srt" / "arg_groups" / "fields").glob("*.py"))
    flags = set(re.findall(r'"(--[a-z-]+)"', BENCH.read_text().split("def run_sglang", 1)[1].split("def main")[0]))
    assert flags, "no flags found in run_sglang"
    missing = {f for f in flags if f'"{f}"' not in bench_src
               and not re.search(rf"^    {f[2:].replace('-', '_')}: ", fields, re.M)}
    assert not missing, f"sglang's offline_throughput takes none of {sorted(missing)}"
    assert '"random-ids"' in (found[0].parent / "datasets" / "__init__.py").read_text()
