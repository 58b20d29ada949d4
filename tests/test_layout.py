"""rayapp.core.layout: the cluster layout schema (docs/scheduler.md §3) and its one-error-per-failure contract."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from rayapp.core.layout import LayoutError, parse_cluster_layout
from rayapp.types import MAX_GPU_ID, NodeSpec

FULL = '{"127.0.0.1": {"gpus": [0, 1, 2, 3], "cpu": 96, "memory_gb": 384}}'
SHORT = '{"127.0.0.1": [0, 1, 2, 3]}'


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in a temp dir so that files are named by short relative paths, as users give them."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- the two forms of a layout (docs/scheduler.md §3) ----------------------------------------------------


def test_full_dict_form_inline() -> None:
    layout = parse_cluster_layout(FULL, default_cpus=8, default_memory_gb=32)
    assert layout == {"127.0.0.1": NodeSpec(gpus=(0, 1, 2, 3), cpu=96.0, memory_gb=384.0)}


def test_shorthand_takes_cpu_and_memory_from_defaults() -> None:
    layout = parse_cluster_layout(SHORT, default_cpus=8, default_memory_gb=32)
    assert layout == {"127.0.0.1": NodeSpec(gpus=(0, 1, 2, 3), cpu=8.0, memory_gb=32.0)}


def test_full_dict_fields_are_optional_and_fall_back_per_field() -> None:
    text = '{"a": {"gpus": [1]}, "b": {"cpu": 4}, "c": {"memory_gb": 0, "cpu": 0, "gpus": [0]}}'
    assert parse_cluster_layout(text, default_cpus=2, default_memory_gb=16) == {
        "a": NodeSpec(gpus=(1,), cpu=2.0, memory_gb=16.0),
        "b": NodeSpec(gpus=(), cpu=4.0, memory_gb=16.0),
        "c": NodeSpec(gpus=(0,), cpu=0.0, memory_gb=0.0),  # an explicit 0 is kept, not defaulted
    }


def test_file_path_str_and_pathlike(in_tmp: Path) -> None:
    (in_tmp / "layout.json").write_text(FULL)
    expected = {"127.0.0.1": NodeSpec(gpus=(0, 1, 2, 3), cpu=96.0, memory_gb=384.0)}
    assert parse_cluster_layout("layout.json") == expected
    assert parse_cluster_layout(in_tmp / "layout.json") == expected
    assert parse_cluster_layout("  layout.json\n") == expected  # as it may come from an env var


def test_file_with_utf8_bom(in_tmp: Path) -> None:
    (in_tmp / "bom.json").write_bytes(b"\xef\xbb\xbf" + SHORT.encode())
    assert parse_cluster_layout("bom.json", 1, 1) == {"127.0.0.1": NodeSpec((0, 1, 2, 3), 1.0, 1.0)}


def test_inline_with_surrounding_whitespace() -> None:
    assert parse_cluster_layout(f"\n  {SHORT}  \n", 1, 2) == {"127.0.0.1": NodeSpec((0, 1, 2, 3), 1.0, 2.0)}


@pytest.mark.parametrize("value", [None, "", "   ", "\n\t"])
def test_no_layout_means_no_pool(value: str | None) -> None:
    assert parse_cluster_layout(value, default_cpus=4, default_memory_gb=8) is None


def test_dict_input() -> None:
    layout = parse_cluster_layout({"n1": [0], "n2": {"gpus": [0, 1], "cpu": 2.5}}, 1, 4)
    assert layout == {"n1": NodeSpec((0,), 1.0, 4.0), "n2": NodeSpec((0, 1), 2.5, 4.0)}
    assert all(isinstance(n.cpu, float) and isinstance(n.memory_gb, float) for n in layout.values())


def test_gpu_order_is_kept() -> None:
    assert parse_cluster_layout('{"a": [3, 1, 2]}', 1, 0)["a"].gpus == (3, 1, 2)


# --- malformed input: exactly one LayoutError naming source, path and reason ----------------------

# (file name or None for inline, content, defaults, expected message with {src} for the source)
MALFORMED = [
    ("a.json", '{"10.0.0.3": {"gpus": [0], "cpu": "x"}}', (0, 0), '$.10.0.0.3.cpu: expected float, got "x"'),
    (None, '{"a": [0, 1,]}', (0, 0), "malformed JSON: trailing comma in array (byte 12)"),
    (None, '{"a": [0] "b": [1]}', (0, 0), "malformed JSON: expected ',' or '}' (byte 10)"),
    (None, '{"a": [0]', (0, 0), "malformed JSON: input data was truncated"),
    (None, '{"a": {"cpu": NaN}}', (0, 0), "malformed JSON: invalid character (byte 14)"),
    ("a.json", '{"a": [0]} trailing', (0, 0), "malformed JSON: trailing characters (byte 12)"),
    (
        None,
        '{"a": {"gpus": [0], "cpus": 4}}',
        (0, 0),
        '$.a: unknown field "cpus" (expected gpus, cpu, memory_gb)',
    ),
    (None, '{"a": {"gpus": [0], "cpu": -1}}', (0, 0), "$.a.cpu: expected finite float >= 0, got -1"),
    (None, '{"a": {"memory_gb": -0.5}}', (1, 0), "$.a.memory_gb: expected finite float >= 0, got -0.5"),
    (None, '{"a": {"cpu": 1e400}}', (0, 0), "$.a.cpu: expected finite float >= 0, got inf"),
    (None, '{"a": {"cpu": true}}', (0, 0), "$.a.cpu: expected float, got true"),
    (None, '{"a": {"cpu": [4]}}', (0, 0), "$.a.cpu: expected float, got an array of 1 item"),
    (None, '{"a": {"gpus": [0, 1, 0]}}', (0, 0), "$.a.gpus[2]: duplicate GPU id 0"),
    (None, '{"10.0.0.1": [2, 2]}', (0, 0), "$.10.0.0.1[1]: duplicate GPU id 2"),
    (None, '{"a": [0, true]}', (0, 0), "$.a[1]: expected int, got true"),
    (None, '{"a": {"gpus": [1.0]}}', (0, 0), "$.a.gpus[0]: expected int, got 1.0"),
    (None, '{"a": ["0"]}', (0, 0), '$.a[0]: expected int, got "0"'),
    (None, '{"a": [-1]}', (0, 0), "$.a[0]: expected int >= 0 and <= 65536, got -1"),
    (None, '{"a": {"gpus": 4}}', (0, 0), "$.a.gpus: expected array, got 4"),
    (None, '{"a": null}', (0, 0), "$.a: expected object | array, got null"),
    (None, '{"a": 4}', (0, 0), "$.a: expected object | array, got 4"),
    (None, '{"": [0]}', (0, 0), '$: expected node names to be non-empty strings, got ""'),
    ("empty.json", "", (0, 0), "file is empty"),
    ("blank.json", " \n\t\n", (0, 0), "file is empty"),
    ("list.json", "[[0, 1]]", (0, 0), "$: expected an object mapping node names to nodes, got an array of 1 item"),
    ("str.json", '"127.0.0.1"', (0, 0), '$: expected an object mapping node names to nodes, got "127.0.0.1"'),
    (None, "{}", (0, 0), "$: expected at least one node, got {}"),
    (None, '{"a": []}', (0, 0), "$.a: node offers nothing (no gpus, cpu 0, memory_gb 0)"),
    (None, '{"a": {"gpus": [], "cpu": 0}}', (0, 0), "$.a: node offers nothing (no gpus, cpu 0, memory_gb 0)"),
    (None, SHORT, (-1, 0), "--env-num-cpus: expected finite float >= 0, got -1"),
    (None, SHORT, (0, float("nan")), "--env-memory-gb: expected finite float >= 0, got nan"),
    (None, SHORT, (float("inf"), 0), "--env-num-cpus: expected finite float >= 0, got inf"),
    (None, SHORT, (True, 0), "--env-num-cpus: expected float, got true"),
    (None, SHORT, (10**400, 0), "--env-num-cpus: expected finite float >= 0, got a very large integer"),
    (None, SHORT, (0, "8"), '--env-memory-gb: expected float, got "8"'),
]


@pytest.mark.parametrize(("file", "content", "defaults", "reason"), MALFORMED)
def test_malformed_gives_one_exact_error(
    in_tmp: Path, file: str | None, content: str, defaults: tuple, reason: str
) -> None:
    if file is not None:
        (in_tmp / file).write_text(content)
    source = file or "<inline>"
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout(file or content, *defaults)
    assert str(info.value) == f'cluster layout "{source}": {reason}'


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ({"a": {"cpu": float("nan")}}, "$.a.cpu: expected finite float >= 0, got nan"),
        ({"a": {"memory_gb": float("inf")}}, "$.a.memory_gb: expected finite float >= 0, got inf"),
        ({"a": {1: 2}}, "$.a: expected str key, got 1"),
        ({7: [0]}, "$: expected node names to be non-empty strings, got 7"),
        ({"a": [False]}, "$.a[0]: expected int, got false"),
        ({"a": {"cpu": 10**400}}, "$.a.cpu: expected finite float >= 0, got a very large integer"),
        ({"a\nb": [0, 0]}, '$."a\\nb"[1]: duplicate GPU id 0'),
        ([["a", [0]]], "$: expected an object mapping node names to nodes, got an array of 1 item"),
        (42, "$: expected an object mapping node names to nodes, got 42"),
        ('{"a": ' + "[" * 100_000, "malformed JSON: nested too deeply"),
        ('{"\ud800": [0]}', "malformed JSON: surrogates not allowed (character 2)"),
    ],
)
def test_malformed_inline_and_dict(value: object, reason: str) -> None:
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout(value, 1, 1)
    assert str(info.value) == f'cluster layout "<inline>": {reason}'


def test_missing_file_and_directory(in_tmp: Path) -> None:
    with pytest.raises(LayoutError, match=r'^cluster layout "nope\.json": cannot read file: No such file'):
        parse_cluster_layout("nope.json")
    (in_tmp / "d").mkdir()
    with pytest.raises(LayoutError, match=r'^cluster layout "d": cannot read file: Is a directory$'):
        parse_cluster_layout(Path("d"))


def test_invalid_utf8_file(in_tmp: Path) -> None:
    (in_tmp / "bin.json").write_bytes(b'{"\xff": [0]}')
    with pytest.raises(LayoutError, match=r'^cluster layout "bin\.json": malformed JSON: invalid UTF-8'):
        parse_cluster_layout("bin.json")


def test_unreadable_file(in_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulated: chmod 0 does not stop root, and these tests may run as root.
    def deny(path, *args, **kwargs) -> int:
        raise PermissionError(13, "Permission denied", str(path))

    (in_tmp / "secret.json").write_text(SHORT)
    monkeypatch.setattr(os, "open", deny)
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout("secret.json")
    assert str(info.value) == 'cluster layout "secret.json": cannot read file: Permission denied'


def test_source_name_replaces_the_source_and_defaults_are_checked_without_layout() -> None:
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout('{"a": []}', source_name="--env-cluster-layout")
    assert str(info.value) == 'cluster layout "--env-cluster-layout": $.a: node offers nothing ' + (
        "(no gpus, cpu 0, memory_gb 0)"
    )
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout(None, default_cpus=-2)
    assert str(info.value) == "cluster layout: --env-num-cpus: expected finite float >= 0, got -2"


# --- properties -----------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_json_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)
# Near-misses of real layouts, so that the node checks (not just the top-level ones) get exercised.
_node_like = (
    st.lists(st.integers(-2, 6) | _scalars, max_size=5)
    | st.dictionaries(st.sampled_from(["gpus", "cpu", "memory_gb", "gpu"]), _json_values, max_size=3)
    | st.dictionaries(
        st.sampled_from(["gpus", "cpu", "memory_gb"]),
        st.lists(st.integers(-1, 5), max_size=4) | st.floats() | st.integers(-3, 10**30),
        max_size=3,
    )
)
_layout_like = st.dictionaries(st.text(max_size=10), _node_like | _json_values, max_size=4)


def _check_result(layout: object) -> None:
    """What every successful parse guarantees."""
    assert isinstance(layout, dict) and layout
    for name, node in layout.items():
        assert isinstance(name, str) and name
        assert isinstance(node, NodeSpec)
        assert all(type(g) is int and g >= 0 for g in node.gpus)
        assert len(set(node.gpus)) == len(node.gpus)
        for amount in (node.cpu, node.memory_gb):
            assert type(amount) is float and math.isfinite(amount) and amount >= 0
        assert node.gpus or node.cpu > 0 or node.memory_gb > 0


@settings(max_examples=300, deadline=None)
@given(value=_layout_like | _json_values, defaults=st.tuples(st.floats(0, 64), st.floats(0, 64)))
def test_any_json_like_value_parses_or_raises_layout_error(value: object, defaults: tuple) -> None:
    inline = json.dumps(value if isinstance(value, dict) else {"n": value})  # NaN/inf become bad JSON
    # A bare string would be read as a file path; strings are the text properties' business.
    for candidate in (inline,) if isinstance(value, str) else (value, inline):
        try:
            layout = parse_cluster_layout(candidate, *defaults)
        except LayoutError as e:
            assert str(e).startswith('cluster layout "<inline>": ')
            event("LayoutError")
        else:
            event("parsed")
            if candidate is not None:  # None is "no layout", the one input that returns None
                _check_result(layout)


@settings(max_examples=200, deadline=None)
@given(defaults=st.tuples(_scalars, _scalars), value=st.sampled_from([None, SHORT, {"a": {"gpus": [0]}}]))
def test_any_defaults_give_a_layout_or_layout_error(defaults: tuple, value: object) -> None:
    try:
        layout = parse_cluster_layout(value, *defaults)
    except LayoutError as e:
        assert str(e).startswith("cluster layout") and "--env-" in str(e)
    else:
        assert value is None or layout["127.0.0.1" if value == SHORT else "a"].cpu == float(defaults[0])


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_any_inline_text_parses_or_raises_layout_error(text: str) -> None:
    try:
        _check_result(parse_cluster_layout("{" + text, 1, 1))
    except LayoutError as e:
        assert str(e).startswith('cluster layout "<inline>": ')


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=64) | _layout_like.map(lambda v: json.dumps(v).encode()))
def test_any_file_content_parses_or_raises_layout_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "layout.json"
    path.write_bytes(data)
    try:
        _check_result(parse_cluster_layout(path, 1, 1))
    except LayoutError as e:
        assert str(e).startswith(f'cluster layout "{path}": ')


_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
_gpu_ids = st.lists(st.integers(0, MAX_GPU_ID), unique=True, max_size=6)
_amounts = st.integers(0, 10**6) | st.floats(0, 1e12)
_nodes = st.one_of(
    _gpu_ids,  # shorthand
    st.fixed_dictionaries({}, optional={"gpus": _gpu_ids, "cpu": _amounts, "memory_gb": _amounts}),
)


@settings(max_examples=250, deadline=None)
@given(
    layout=st.dictionaries(_names, _nodes, min_size=1, max_size=5),
    default_cpus=_amounts,
    default_memory_gb=_amounts,
)
def test_valid_layouts_round_trip(layout: dict, default_cpus: float, default_memory_gb: float) -> None:
    expected = {}
    for name, node in layout.items():
        full = isinstance(node, dict)
        gpus = tuple(node.get("gpus", ())) if full else tuple(node)
        cpu = node.get("cpu", default_cpus) if full else default_cpus
        mem = node.get("memory_gb", default_memory_gb) if full else default_memory_gb
        expected[name] = (gpus, cpu, mem)
    assume(all(gpus or cpu or mem for gpus, cpu, mem in expected.values()))  # else "offers nothing"
    for value in (layout, json.dumps(layout)):
        parsed = parse_cluster_layout(value, default_cpus, default_memory_gb)
        assert parsed is not None and parsed.keys() == expected.keys()
        for name, (gpus, cpu, mem) in expected.items():
            assert parsed[name] == NodeSpec(gpus=gpus, cpu=float(cpu), memory_gb=float(mem))


@pytest.mark.parametrize(("text", "key"), [
    ('{"10.0.0.1": [0], "10.0.0.1": [1]}', "10.0.0.1"),
    ('{"a": {"gpus": [0], "cpu": 1, "cpu": 2}}', "cpu"),
])
def test_a_key_written_twice_is_reported_not_lost(text, key, tmp_path):
    with pytest.raises(LayoutError, match=f'cluster layout "<inline>": duplicate key "{key}"'):
        parse_cluster_layout(text)
    path = tmp_path / "dup.json"
    path.write_text(text)
    with pytest.raises(LayoutError, match=f'"{path}": duplicate key "{key}"'):
        parse_cluster_layout(str(path))


# --- edges: bounded ids, a list only, inline JSON by its first character, long input cut, overflow ----


@pytest.mark.parametrize(("layout", "message"), [
    ({"n": [10**5000]}, "$.n[0]: expected int >= 0 and <= 65536, got a very large integer"),
    ({"n": {"gpus": [MAX_GPU_ID + 1]}}, f"$.n.gpus[0]: expected int >= 0 and <= 65536, got {MAX_GPU_ID + 1}"),
    ({"n": {1, 2}}, "$.n: expected an array of GPU ids, got a set of 2"),
    ({"n": {"gpus": frozenset({0})}}, "$.n.gpus: expected an array of GPU ids, got a set of 1"),
    ({"n": {"cpu": 1.7e308}}, "$.n.cpu: expected at most 1.79769e+305, got 1.7e+308"),
    ({"n": {"gpus": [0], "memory_gb": 1e307}}, "$.n.memory_gb: expected at most 1.75556e+305, got 1e+307"),
])
def test_gpu_ids_are_bounded_integers_in_a_list_and_amounts_fit_the_pools_units(layout, message) -> None:
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout(layout)
    assert str(info.value) == f'cluster layout "<inline>": {message}'


def test_a_default_whose_units_overflow_is_a_layout_error() -> None:
    with pytest.raises(LayoutError, match=r"^cluster layout: --env-num-cpus: expected at most 1\.79769e\+305"):
        parse_cluster_layout(None, default_cpus=1e308)


@pytest.mark.parametrize("text", ['"[1,2]"', "[1,2]", '  [0]', '\n"x"', "{"])
def test_inline_json_is_recognised_by_its_first_character_never_read_as_a_file(text, in_tmp: Path) -> None:
    (in_tmp / text).write_text(SHORT)  # a file of that very name is not read
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout(text)
    assert str(info.value).startswith('cluster layout "<inline>": ')
    assert "cannot read file" not in str(info.value)


@pytest.mark.parametrize("value", ["x" * 200_000, {"n" * 200_000: [0, 0]}, '{"' + "k" * 200_000 + '": [-1]}'])
def test_a_long_bad_input_is_cut_in_the_message(value) -> None:
    with pytest.raises(LayoutError) as info:
        parse_cluster_layout(value)
    message = str(info.value)
    assert len(message) < 1_000 and "more characters)" in message
