"""recipes/plot_runs.py: two GRPO runs' history.json files on one plot, and the per-step comparison it
prints (the difference in standard errors of 64 held-out arithmetic problems)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plot_runs():
    spec = importlib.util.spec_from_file_location("plot_runs", ROOT / "recipes" / "plot_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def history(path, accs):
    rows = [{"step": 0, "acc_arithmetic": accs[0], "acc_word": 0.0, "eval_samples": 128.0}]
    rows += [{"step": 1, "reward_mean": 0.1}]  # a training step without an eval is skipped
    rows += [{"step": 3, "acc_arithmetic": accs[1], "acc_word": 0.0, "eval_samples": 128.0}]
    path.write_text(json.dumps(rows))
    return path


def test_two_runs_on_one_plot_with_their_difference_in_standard_errors(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a, b = history(tmp_path / "a.json", [0.0, 0.25]), history(tmp_path / "b.json", [0.0, 0.25])
    out = tmp_path / "cmp.png"
    assert plot_runs().main([f"native={a}", f"gateway={b}", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "native: held-out arithmetic accuracy step 0: 0.000 (word 0.000); step 3: 0.250" in text
    assert "step 3: 0.250 (word 0.000) [+0.0 se vs native]" in text


def test_a_run_of_several_seeds_is_their_mean_at_the_steps_all_evaluated(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    seeds = [history(tmp_path / f"n{i}.json", [0.0, acc]) for i, acc in enumerate((0.25, 0.5))]
    longer = [*json.loads(seeds[1].read_text()), {"step": 6, "acc_arithmetic": 0.9, "acc_word": 0.0}]
    seeds[1].write_text(json.dumps(longer))  # a step only one seed reached is left out of the mean
    other = history(tmp_path / "g.json", [0.0, 0.375])
    out = tmp_path / "cmp.png"
    assert plot_runs().main([f"native={seeds[0]},{seeds[1]}", f"gateway={other}", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "native: held-out arithmetic accuracy step 0: 0.000 (word 0.000) = mean of 0.000/0.000; " \
           "step 3: 0.375 (word 0.000) = mean of 0.250/0.500\n" in text
    assert "gateway: held-out arithmetic accuracy step 0: 0.000 (word 0.000) [+0.0 se vs native]; " \
           "step 3: 0.375 (word 0.000) [+0.0 se vs native]\n" in text


def test_a_run_without_an_eval_or_a_bad_argument_is_one_clear_error(tmp_path):
    bare = tmp_path / "h.json"
    bare.write_text(json.dumps([{"step": 1, "reward_mean": 0.1}]))
    with pytest.raises(SystemExit, match="no held-out evaluation"):
        plot_runs().main([f"x={bare}"])
    with pytest.raises(SystemExit, match="expected LABEL=PATH"):
        plot_runs().main([str(bare)])


@pytest.mark.parametrize("script", ["train_grpo.py", "train_grpo_trl.py", "plot_runs.py"])
def test_the_training_scripts_import_and_answer_help(script):
    """The demo scripts import each other's pieces (train_grpo_trl.py takes train_grpo.py's): a renamed
    one breaks `make demo-train-trl` only minutes into a run, so each is started here with --help."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / script), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
