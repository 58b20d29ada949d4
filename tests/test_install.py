"""rayapp outside a checkout: a wheel built from this tree, installed into a throwaway venv, works from
a folder that is not the checkout (``rayapp --version``, ``validate`` of a shipped recipe and of a
broken one, ``init``); and the modules the manager and the CLI import need no torch (it comes only
with the ``hf`` extra). The venv sees the project venv's packages (Ray, msgspec, ...) through a
``.pth`` line, not its own installs: this checks what the wheel carries, offline, in seconds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin folder of a venv holding only the wheel built from this tree."""
    base = tmp_path_factory.mktemp("install")
    # pip builds in the source tree (build/, *.egg-info): build a copy, leaving the checkout as it is
    source, wheels = base / "source", base / "wheels"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's rayapp is not installed
    # --no-build-isolation: setuptools from this venv, so the build needs no network
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(source)], check=True, timeout=300, capture_output=True, cwd=base, env=env)
    (wheel,) = wheels.glob("rayapp-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    # a path line, not a site dir: the project venv's own .pth files (its editable rayapp) are not read
    Path(purelib, "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: the project venv's rayapp (seen through the .pth) is neither reused nor removed
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--ignore-installed", "-q", str(wheel)], check=True, timeout=300, capture_output=True, env=env)
    return venv / "bin"


def _outside(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the checkout on the path
    return {"env": env, "cwd": tmp_path, "capture_output": True, "text": True, "timeout": 120}


def test_the_installed_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    out = subprocess.run([str(installed / "python"), "-c", "import rayapp; print(rayapp.__file__)"],
                         **_outside(tmp_path))
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(installed.parent)


def test_version_and_validate_work_outside_a_checkout(installed, tmp_path):
    rayapp = str(installed / "rayapp")
    version = subprocess.run([rayapp, "--version"], **_outside(tmp_path))
    assert version.returncode == 0 and version.stdout.startswith("rayapp 0.") and "(ray 2." in version.stdout
    for name in ("local", "dagger_local", "grpo_sglang"):
        ok = subprocess.run([rayapp, "validate", name], **_outside(tmp_path))
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip().endswith(f"/rayapp/cli/recipes/{name}/rollout.yaml: OK")
        assert Path(ok.stdout.split(":")[0]).is_relative_to(installed.parent)  # the copy the wheel carries
    # a broken recipe of the user's own: the recipe's error and Serve's, by JSON path, exit 2
    doc = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())
    doc["applications"][0]["args"]["engines"]["student"]["backend"] = "vllm"
    doc["proxy_location"] = "Everywhere"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(doc))
    bad = subprocess.run([rayapp, "validate", "mine.yaml"], **_outside(tmp_path))
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        'recipe "mine.yaml": $.applications[0].args.engines.student.backend: expected "hf" or "sglang", got "vllm"',
        "recipe \"mine.yaml\": $.proxy_location: Input should be 'Disabled', 'HeadOnly' or 'EveryNode'"]


def test_init_and_schema_work_outside_a_checkout(installed, tmp_path):
    rayapp = str(installed / "rayapp")
    init = subprocess.run([rayapp, "init", "swe", "--recipe", "swe_dagger"], **_outside(tmp_path))
    assert init.returncode == 0, init.stderr
    assert (tmp_path / "swe" / "rollout.yaml").read_text() == (ROOT / "recipes" / "swe_dagger" / "rollout.yaml"
                                                               ).read_text()
    ok = subprocess.run([rayapp, "validate", "rollout.yaml"], **{**_outside(tmp_path), "cwd": tmp_path / "swe"})
    assert ok.returncode == 0, ok.stderr  # its layout file came along, where its relative path points
    schema = subprocess.run([rayapp, "schema"], **_outside(tmp_path))
    assert schema.returncode == 0 and '"RecipeConfig"' in schema.stdout


def test_the_manager_and_the_cli_import_without_torch(tmp_path, model_dir):
    """torch comes with the hf extra only: the Serve app (manager, pool, engine shell) and the CLI
    must import, and the tokenizer must load, where it is absent."""
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        import rayapp.actors.app, rayapp.actors.manager, rayapp.actors.engine, rayapp.actors.pool_service
        import rayapp.actors.sandbox, rayapp.cli, rayapp.recipe, rayapp.steps.reuse
        from rayapp.inference.tiny_model import load_tokenizer
        tok = load_tokenizer(sys.argv[1])
        ids = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert ids and "torch" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
