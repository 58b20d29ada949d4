"""How long a plug-in may take to import (issue 32, point 9): a limit that fits real imports (``openai``
or ``agents`` on a loaded machine take many seconds), settable by ``RAYAPP_PLUGIN_TIMEOUT_S`` or
``rayapp validate --plugin-timeout``, and a timeout that says whether the import was slow (modules
still loading) or stuck (none loading)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rayapp.cli import LOCAL_ENV, ROOT
from rayapp.cli.check import problems
from rayapp.envs.plugin_import import IMPORT_TIMEOUT_S, TIMEOUT_ENV, PluginError, import_object, plugin_timeout_s

GOOD = ROOT / "recipes" / "local" / "rollout.yaml"


def _slow_package(folder: Path, name: str, modules: int, each_s: float) -> str:
    """A package whose import loads ``modules`` submodules, each sleeping ``each_s``: slow, never stuck."""
    pkg = folder / name
    pkg.mkdir()
    for i in range(modules):
        (pkg / f"m{i}.py").write_text(f"import time\ntime.sleep({each_s})\n")
    (pkg / "__init__.py").write_text("".join(f"from . import m{i}\n" for i in range(modules))
                                     + "def rows(cfg):\n    return []\n")
    return name


def _recipe_with_source(folder: Path, source: str) -> Path:
    doc = yaml.safe_load(GOOD.read_text())
    doc["applications"][0]["args"]["data"]["arithmetic"]["source"] = source
    path = folder / "rollout.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_default_limit_fits_real_imports_and_the_variable_sets_another(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert plugin_timeout_s() == IMPORT_TIMEOUT_S >= 60
    monkeypatch.setenv(TIMEOUT_ENV, "240")
    assert plugin_timeout_s() == 240
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(PluginError, match=f"{TIMEOUT_ENV}='{bad}': expected a positive number of seconds"):
            plugin_timeout_s()


def test_a_slow_import_is_called_slow_and_says_how_to_allow_more(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(TIMEOUT_ENV, "2")
    name = _slow_package(tmp_path, "slowpkg_a", modules=400, each_s=0.05)
    with pytest.raises(PluginError) as err:
        import_object(f"{name}:rows", "data source")
    message = str(err.value)
    assert "still importing after 2 s, slow:" in message and "modules loaded so far" in message, message
    assert f"{TIMEOUT_ENV}=<seconds>" in message and "--plugin-timeout" in message
    assert "block" not in message


def test_a_stuck_import_is_called_stuck(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    (tmp_path / "stuckmod_a.py").write_text("import time\ntime.sleep(30)\n")
    with pytest.raises(PluginError) as err:
        import_object("stuckmod_a:rows", "data source")
    message = str(err.value)
    assert "still importing after 1 s, no module loaded" in message and "block or wait" in message, message
    assert "slow:" not in message


def test_validate_passes_an_import_that_takes_longer_than_the_old_five_seconds(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    (tmp_path / "heavymod_a.py").write_text("import time\nfrom rayapp.types import Task, TaskConfig\ntime.sleep(7)\n"
                                            "def rows(cfg):\n    return [Task('t0', 'p', TaskConfig('arithmetic'))]\n")
    assert problems(_recipe_with_source(tmp_path, "heavymod_a:rows")) == []


def test_the_cli_flag_sets_the_limit(tmp_path):
    (tmp_path / "stuckmod_b.py").write_text("import time\ntime.sleep(60)\n")
    recipe = _recipe_with_source(tmp_path, "stuckmod_b:rows")
    env = {**os.environ, **LOCAL_ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    env.pop(TIMEOUT_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "rayapp.cli", "validate", "--plugin-timeout", "1.5", str(recipe)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc
    (line,) = proc.stderr.strip().splitlines()
    assert ".data.arithmetic.source" in line and "still importing after 1.5 s, no module loaded" in line, line
    bad = subprocess.run([sys.executable, "-m", "rayapp.cli", "validate", "--plugin-timeout", "0", str(recipe)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--plugin-timeout 0: expected a positive number of seconds" in bad.stderr
