"""`make test` runs each tests/isolated file in a pytest process of its own and stops at the first
non-zero exit. A module-level ``pytest.importorskip`` of a package the test extras do not install
skips the whole module at collection: pytest then collects nothing and exits 5, and CI fails on a
machine without that package (slime, installed from its source, failed CI so). Such a skip belongs
in a fixture, where the test is collected and skipped."""

import ast
import importlib.util
from pathlib import Path

import pytest

ISOLATED = sorted((Path(__file__).parent / "isolated").glob("test_*.py"))


def module_level_skips(path: Path) -> list[str]:
    """The packages a file's top-level statements importorskip."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # runs at a test's or a fixture's set-up, not at collection
        for call in ast.walk(node):
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and call.func.attr == "importorskip" and call.args
                    and isinstance(call.args[0], ast.Constant)):
                names.append(call.args[0].value)
    return names


@pytest.mark.parametrize("path", ISOLATED, ids=lambda p: p.name)
def test_isolated_files_skip_only_inside_fixtures(path):
    for name in module_level_skips(path):
        top = name.split(".")[0]
        assert importlib.util.find_spec(top) is not None, (
            f"{path.name}: module-level importorskip({name!r}) with {top} not installed collects nothing "
            "(pytest exit 5 stops make test); skip in a fixture instead")


def test_the_check_sees_a_module_level_skip(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import pytest\nx = pytest.importorskip('no_such_pkg.sub')\n")
    assert module_level_skips(f) == ["no_such_pkg.sub"]
