"""The GPU install's pins agree everywhere they are written: pyproject's `sglang` extra, the constraints
file a GPU user installs with, cluster/Dockerfile and the KubeRay rayVersion; and the constraints equal
the pins SGLang itself declares (read from an installed sglang's METADATA, or the project's sglang
venv when it is there; skipped when neither is). Reads files only: no network, no GPU."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "cluster" / "constraints-cu13.txt"
DOCKERFILE = ROOT / "cluster" / "Dockerfile"
KUBERAY = ROOT / "cluster" / "kuberay-rayservice.yaml"
LAUNCHER = ROOT / "cluster" / "ray-cluster.yaml"
SGLANG_VENV_METADATA = sorted(ROOT.parent.glob(
    "*/.venv-sglang/lib/python3*/site-packages/sglang-*.dist-info/METADATA"))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(lines: list[str], where: str) -> dict[str, str]:
    """name -> version for each `name==version` line (comments and markers aside); anything else is an error."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!]+)", line)
        if m is None:
            raise ValueError(f"{where}:{n}: expected name==version, got {raw.strip()!r}")
        pins[_norm(m.group(1))] = m.group(2)
    return pins


def constraints() -> dict[str, str]:
    return parse_pins(CONSTRAINTS.read_text().splitlines(), str(CONSTRAINTS))


def dockerfile_args() -> dict[str, str]:
    args: dict[str, str] = {}
    for m in re.finditer(r"^ARG (\w+)=(\S+)$", DOCKERFILE.read_text(), re.M):
        assert args.setdefault(m.group(1), m.group(2)) == m.group(2), f"ARG {m.group(1)} given twice, differently"
    return args


def sglang_metadata_pins(text: str) -> dict[str, str]:
    """SGLang's unconditional `==` pins (not those of its extras), as Requires-Dist lines carry them."""
    pins = {}
    for m in re.finditer(r"^Requires-Dist: ([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;]+)(.*)$", text, re.M):
        if "extra ==" not in m.group(3):
            pins[_norm(m.group(1))] = m.group(2)
    return pins


def test_parse_pins_rejects_what_pip_would_read_differently():
    assert parse_pins(["torch==2.14.1  # why", "", "# note"], "c") == {"torch": "2.14.1"}
    for bad in ("torch>=2.14", "ray[serve]==2.60.0", "torch"):
        with pytest.raises(ValueError, match="c:1: expected name==version"):
            parse_pins([bad], "c")


def test_extra_dockerfile_and_kuberay_agree_with_the_constraints():
    pins = constraints()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["sglang"] == [f"sglang=={pins['sglang']}"]
    args = dockerfile_args()
    assert {k: args[k] for k in ("SGLANG_VERSION", "TORCH_VERSION", "TRANSFORMERS_VERSION", "RAY_VERSION")} == {
        "SGLANG_VERSION": pins["sglang"], "TORCH_VERSION": pins["torch"],
        "TRANSFORMERS_VERSION": pins["transformers"], "RAY_VERSION": pins["ray"]}
    text = DOCKERFILE.read_text()
    assert "FROM lmsysorg/sglang:v${SGLANG_VERSION}-cu130" in text
    assert "-c cluster/constraints-cu13.txt" in text
    # the pinned Ray satisfies rayapp's own range
    ray = next(r for r in map(Requirement, project["dependencies"]) if r.name == "ray")
    assert ray.specifier.contains(pins["ray"]), (str(ray), pins["ray"])
    kuberay = next(d for d in yaml.safe_load_all(KUBERAY.read_text()) if d and d.get("kind") == "RayService")
    cluster = kuberay["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == pins["ray"]
    images = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]]
    images += [g["template"]["spec"]["containers"][0]["image"] for g in cluster["workerGroupSpecs"]]
    tag = f"<your-registry>/rayapp:{project['version']}-sglang{pins['sglang']}"
    assert images == [tag] * len(images)
    assert f"docker build -f cluster/Dockerfile -t {tag} ." in text
    setup = " ".join(yaml.safe_load(LAUNCHER.read_text())["setup_commands"])
    assert "-c $HOME/rayapp-src/cluster/constraints-cu13.txt" in setup and f"ray[serve]=={pins['ray']}" in setup


def _installed_sglang_metadata() -> list[str]:
    try:
        return [importlib.metadata.distribution("sglang").read_text("METADATA") or ""]
    except importlib.metadata.PackageNotFoundError:
        return [p.read_text() for p in SGLANG_VENV_METADATA]


@pytest.mark.parametrize("metadata", _installed_sglang_metadata() or [pytest.param(
    None, marks=pytest.mark.skip(reason="no sglang installed and no .venv-sglang beside this checkout"))])
def test_constraints_equal_sglangs_own_pins(metadata):
    version = re.search(r"^Version: (\S+)$", metadata, re.M).group(1)
    pins = constraints()
    if version != pins["sglang"]:
        pytest.skip(f"the sglang found is {version}, the constraints pin {pins['sglang']}")
    theirs = sglang_metadata_pins(metadata)
    ours = {k: v for k, v in pins.items() if k not in ("sglang", "ray")}
    assert ours == {k: theirs.get(k) for k in ours}, "constraints differ from sglang's METADATA"
    for clash in ("torch", "transformers"):  # the pins that clash with the CPU lane's must be there
        assert clash in ours
