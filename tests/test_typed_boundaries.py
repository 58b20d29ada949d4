"""Facts a reviewer checks with grep, kept true: inside the project an episode's record is read as
attributes (``Sample.episode``); the spec's metadata key strings appear only in the trainer's door
(``rayapp/training/converters.py``); and in ``rayapp/training`` only the one observer
(``stacx_env.py``) writes the process environment. Read from the source's syntax tree, so that a
comment or docstring naming a key is no hit, and any spelling of a write is."""

import ast
from pathlib import Path

import rayapp
from rayapp.training.converters import EpisodeKey

ROOT = Path(rayapp.__file__).parent
DOOR = ROOT / "training" / "converters.py"
ENV_WRITER = ROOT / "training" / "stacx_env.py"
# the timing record's fields, read by name before it was typed; and the legacy task keys partial
# rollouts once handed a carried group's task, which only the door still reads back from old files
RECORD_STRINGS = {k.value for k in EpisodeKey} | {"started", "queued", "_resume_points", "_partial_sample_indices"}
ENV_NAMES = {"env", "environ"}
WRITES = {"update", "pop", "popitem", "setdefault", "clear", "__setitem__", "__delitem__"}


def _trees(root: Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _strings(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ``, or a name an environment is bound to here (``env``, ``environ``)."""
    return ((isinstance(node, ast.Attribute) and node.attr == "environ")
            or (isinstance(node, ast.Name) and node.id in ENV_NAMES))


def _env_writes(tree: ast.AST) -> list[int]:
    lines = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AugAssign) else []
        if isinstance(n, ast.Delete):
            targets = n.targets
        lines += [n.lineno for t in targets if isinstance(t, ast.Subscript) and _is_environ(t.value)]
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            f = n.func
            if (f.attr in WRITES and _is_environ(f.value)) or f.attr in {"putenv", "unsetenv"}:
                lines.append(n.lineno)
    return lines


def test_episode_record_strings_are_read_and_written_only_at_the_trainers_door():
    found = {str(p.relative_to(ROOT)): sorted(_strings(t) & RECORD_STRINGS) for p, t in _trees(ROOT) if p != DOOR}
    assert {p: keys for p, keys in found.items() if keys} == {}
    assert {"_timing", "_termination_reason", "_placement"} <= _strings(ast.parse(DOOR.read_text()))


def test_only_the_one_observer_writes_the_environment_in_training():
    found = {str(p.relative_to(ROOT)): _env_writes(t) for p, t in _trees(ROOT / "training") if p != ENV_WRITER}
    assert {p: lines for p, lines in found.items() if lines} == {}
    assert _env_writes(ast.parse(ENV_WRITER.read_text()))  # the check sees the writes that are there


def test_the_check_catches_each_spelling_of_a_write():
    for code in ("os.environ['X'] = '1'", "env[k] = v", "os.environ.update(x)", "environ.pop('X')",
                 "os.putenv('X', '1')", "del os.environ['X']", "env.setdefault('X', '1')"):
        assert _env_writes(ast.parse(code)), code
    assert not _env_writes(ast.parse("x = os.environ.get('X', '')\ny = env['X']"))
