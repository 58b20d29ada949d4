import subprocess
import sys


def assert_imports_none_of(modules: str, roots: tuple[str, ...]) -> None:
    """Importing ``modules`` (comma-separated) in a fresh interpreter loads no package under ``roots``."""
    code = (f"import sys, {modules}; "
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {roots!r}); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_the_core_and_the_package_does_not_import_ray():
    assert_imports_none_of("rayapp, rayapp.core.scheduler, rayapp.core.pool, rayapp.core.evaluator, rayapp.demo",
                           ("ray",))


def test_the_recipe_the_wiring_and_the_step_pipeline_import_neither_ray_nor_fastapi():
    assert_imports_none_of("rayapp.recipe, rayapp.steps.runner, rayapp.steps.checkpoint", ("ray", "fastapi"))


def test_no_core_module_mentions_an_import_of_ray():
    import re
    from pathlib import Path

    import rayapp.core

    ray_import = re.compile(r"^\s*(import|from)\s+ray(\s|\.|,|$)")
    for path in Path(rayapp.core.__file__).parent.glob("*.py"):
        for line in path.read_text().splitlines():
            assert not ray_import.match(line), f"{path.name}: {line}"


def test_public_api_is_importable_from_the_package_root():
    import rayapp

    for name in ["TaskScheduler", "BatchingStrategy", "fifo_batching", "PlacementPool", "Resource",
                 "EvaluatorSpec", "StoppingCriteria", "Task", "Batch", "Sample", "classify_abort",
                 "classify_termination", "parse_cluster_layout"]:
        assert hasattr(rayapp, name), name
    assert set(rayapp.__all__) <= set(dir(rayapp))


def test_the_package_imports_no_trainer_and_the_trl_adapter_not_trl():
    assert_imports_none_of("rayapp, rayapp.trainers, rayapp.trainers.sync", ("trl", "accelerate", "datasets", "verl"))
    # the adapter needs only what TRL's loop hands it, and transformers' callback base (which loads accelerate)
    assert_imports_none_of("rayapp.trainers.trl", ("trl",))


def test_the_recipe_package_has_no_import_cycle_even_through_imports_inside_functions():
    """Issue 31 point 4: ``recipe/config.py`` imported ``recipe/wiring.py`` inside a function while the
    wiring imported the config; each module of ``rayapp/recipe`` now sits above the ones it imports."""
    import ast
    from pathlib import Path

    import rayapp.recipe

    folder = Path(rayapp.recipe.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        graph[path.stem] = {n.split(".")[2] if n.count(".") >= 2 else "__init__" for n in names
                            if n == "rayapp.recipe" or n.startswith("rayapp.recipe.")} - {path.stem}
        graph[path.stem] &= {p.stem for p in folder.glob("*.py")} | {"__init__"}

    def cycle_from(start: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(graph.get(start, ())):
            if nxt in seen:
                return (*seen[seen.index(nxt):], nxt)
            if (found := cycle_from(nxt, (*seen, nxt))) is not None:
                return found
        return None

    cycles = [c for m in sorted(graph) if (c := cycle_from(m, (m,))) is not None]
    assert not cycles, f"import cycle in rayapp/recipe: {' -> '.join(cycles[0])}"
    assert graph["load"] >= {"config", "wiring"} and "load" not in graph["config"] | graph["wiring"]


# rayapp's folders (and top-level modules) from the bottom up, as docs/architecture.md lists them:
# each imports only those before it. ``rayapp/__init__.py`` re-exports the public API and is left out.
LAYERS = ("record", "types", "episode", "connection", "core", "verify", "inference", "envs", "gateway",
          "trainers", "steps", "recipe", "actors", "demo", "cli", "knobs")


def _imported_layers(path) -> set[str]:
    """The top-level parts of rayapp a module imports, inside functions too (``from rayapp import cli``
    names ``cli``)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "rayapp" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        found |= {n.split(".")[1] for n in names if n.startswith("rayapp.")}
    return found


def test_each_folder_imports_only_the_folders_below_it():
    """Issue 31 point 3: no import runs back up (so there is no cycle between folders either)."""
    from pathlib import Path

    import rayapp

    root = Path(rayapp.__file__).parent
    upward = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel == Path("__init__.py") or "swe_repos" in rel.parts:
            continue
        layer = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        assert layer in LAYERS, f"{rel}: a new folder or module of rayapp goes into LAYERS"
        upward += [f"{rel} imports rayapp.{d}" for d in _imported_layers(path)
                   if d != layer and LAYERS.index(d) > LAYERS.index(layer)]
    assert not upward, upward


def test_the_layer_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from rayapp.steps.runner import StepRunner\n    from rayapp import cli\n")
    assert _imported_layers(module) == {"steps", "cli"}
