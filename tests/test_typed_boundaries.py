"""Facts a reviewer checks with grep, kept true: inside the project an episode's record is read as
attributes (``Sample.episode``); the spec's metadata key strings appear only in the trainer's door
(``rayapp/trainers/converters.py``); and in ``rayapp/steps`` only the one observer
(``stacx_env.py``) writes the process environment. Read from the source's syntax tree, so that a
comment or docstring naming a key is no hit, and any spelling of a write is."""

import ast
from pathlib import Path

import rayapp
from rayapp.trainers.converters import EpisodeKey

ROOT = Path(rayapp.__file__).parent
DOOR = ROOT / "trainers" / "converters.py"
ENV_WRITER = ROOT / "steps" / "stacx_env.py"
# the timing record's fields, read by name before it was typed
RECORD_STRINGS = {k.value for k in EpisodeKey} | {"started", "queued"}
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


def test_only_the_one_observer_writes_the_environment_in_the_step_pipeline():
    found = {str(p.relative_to(ROOT)): _env_writes(t) for p, t in _trees(ROOT / "steps") if p != ENV_WRITER}
    assert {p: lines for p, lines in found.items() if lines} == {}
    assert _env_writes(ast.parse(ENV_WRITER.read_text()))  # the check sees the writes that are there


def test_the_check_catches_each_spelling_of_a_write():
    for code in ("os.environ['X'] = '1'", "env[k] = v", "os.environ.update(x)", "environ.pop('X')",
                 "os.putenv('X', '1')", "del os.environ['X']", "env.setdefault('X', '1')"):
        assert _env_writes(ast.parse(code)), code
    assert not _env_writes(ast.parse("x = os.environ.get('X', '')\ny = env['X']"))


# ---- one type per meaning: the step kind (rayapp.types.StepKind) and the weight version
# (rayapp.record.WeightVersion) are spelled and read only in their own modules.

KIND_STRINGS = {"rollout", "eval"}
TYPES_MODULES = {ROOT / "types.py", ROOT / "record.py"}
# The same words with other meanings, at most this many times in each file: the recipe's ``eval``
# section (its eval datasets, a JSON key), Python's ``mode="eval"``, a trainer source's ``rollout``
# method, and the spec's name of the verify phase. A step kind is ``StepKind``; one more spelling
# here is a step kind in disguise.
OTHER_MEANINGS = {
    ("cli/verify.py", "eval"): 3,  # the recipe's eval section
    ("recipe/config.py", "eval"): 2,  # the recipe's eval section
    ("recipe/paths.py", "eval"): 1,  # the recipe's eval section
    ("recipe/plugin_checks.py", "eval"): 1,  # the recipe's eval section
    ("recipe/runnable.py", "eval"): 1,  # the recipe's eval section
    ("recipe/wiring.py", "eval"): 2,  # the recipe's eval section
    ("envs/agents/tools.py", "eval"): 1,  # ast.parse(expr, mode="eval")
    ("trainers/trl.py", "rollout"): 1,  # getattr(source, "rollout"): the source's method
    ("trainers/converters.py", "eval"): 1,  # the spec's name of the verify phase in ``_abort``
}
PARSERS = {"isdigit", "isdecimal", "isnumeric"}


def _kind_strings(tree: ast.AST) -> list[str]:
    """Every exact "rollout" / "eval" constant, but not the text pieces of an f-string."""
    pieces = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in KIND_STRINGS and id(n) not in pieces]


def _version_parsing(tree: ast.AST) -> list[int]:
    """Lines that parse or compare a weight version as text: ``.isdigit()`` (and its kin) of it,
    ``int(...)`` of it, or a comparison with ``str(...)`` of it or with a string. A version is an
    expression naming ``version`` (``t.weight_version``, ``record.version``) or a name assigned one."""
    tainted = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and _names_version(n.value, set())
               for t in n.targets if isinstance(t, ast.Name)}

    def version(node: ast.AST) -> bool:
        return _names_version(node, tainted)

    def text_of_version(node: ast.AST) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str"
                and any(map(version, node.args)))

    lines = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call):
            f = n.func
            parses = isinstance(f, ast.Attribute) and f.attr in PARSERS and version(f.value)
            converts = isinstance(f, ast.Name) and f.id == "int" and any(map(version, n.args))
            if parses or converts:
                lines.append(n.lineno)
        elif isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            if any(map(text_of_version, sides)) or (strings and any(version(s) for s in sides if s not in strings)):
                lines.append(n.lineno)
    return lines


def _names_version(node: ast.AST, tainted: set[str]) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and ("version" in n.id.lower() or n.id in tainted):
            return True
        if isinstance(n, ast.Attribute) and "version" in n.attr.lower():
            return True
    return False


def test_step_kinds_are_spelled_only_as_the_enum():
    found = {}
    for p, t in _trees(ROOT):
        if p in TYPES_MODULES:
            continue
        rel = str(p.relative_to(ROOT))
        for word in KIND_STRINGS:
            n = _kind_strings(t).count(word)
            if n > OTHER_MEANINGS.get((rel, word), 0):
                found[rel, word] = n
    assert found == {}


def test_weight_versions_are_never_parsed_or_compared_as_text():
    found = {str(p.relative_to(ROOT)): _version_parsing(t) for p, t in _trees(ROOT) if p not in TYPES_MODULES}
    assert {p: lines for p, lines in found.items() if lines} == {}


def test_the_checks_catch_what_they_are_for_and_pass_what_is_not():
    # step kinds: a bare one anywhere counts, route paths and log text do not
    assert _kind_strings(ast.parse('run("rollout", 3)\nkind == "eval"\nd = {"rollout": 1}')) == ["rollout", "eval",
                                                                                                "rollout"]
    assert not _kind_strings(ast.parse('@api.get("/rollout/{rollout_id}")\ndef f(): pass\n'
                                       'log.info(f"eval {n} done")\nlog.info("rollout %d reuses", n)'))
    # weight versions: the parsing and text comparisons partial rollouts and weight sync once did
    for code in ('v = t.weight_version or ""\nok = v.lstrip("-").isdigit()',
                 "n = int(turn.weight_version)",
                 "lag = weight_version != str(record.version)",
                 'stale = out.weight_version == "0"'):
        assert _version_parsing(ast.parse(code)), code
    # ... and not the integer comparisons, other digits, or a version handed to an engine as its text
    assert not _version_parsing(ast.parse('lag = weight_version != record.version\nok = pid.isdigit()\n'
                                          'req = Update(weight_version=str(version))\n'
                                          'if e.backend == "sglang" and "weight_version" in e.options: pass\n'
                                          'same = ip.version == 4'))
