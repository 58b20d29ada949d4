import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.strip().splitlines()] == [["make", "demo"], ["make", "test"]]


def test_the_readme_example_runs(tmp_path):
    code = re.search(r"## The core in one process\n.*?```python\n(.*?)```", (ROOT / "README.md").read_text(),
                     re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("done arithmetic-0-") == 4
    assert "eval/easy/pass@4" in proc.stdout and "eval/hard/accuracy" in proc.stdout


def test_the_demo_runs_and_returns_the_pool_to_its_initial_state():
    proc = subprocess.run([sys.executable, "-m", "rayapp.demo", "--no-progress"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "pool back to its initial state: True" in proc.stdout
    assert "eval/arith-easy/pass@4" in proc.stdout
