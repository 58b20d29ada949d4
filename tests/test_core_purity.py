import subprocess
import sys


def test_importing_the_core_and_the_package_does_not_import_ray():
    code = ("import sys, rayapp, rayapp.core.scheduler, rayapp.core.pool, rayapp.core.evaluator, rayapp.demo; "
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


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
