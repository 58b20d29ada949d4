"""rayapp.core.convert, the one door for outside input: one InputError naming source, path and value."""

from __future__ import annotations

import enum
import pickle
import sys
from typing import Annotated, Any, Literal

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.core.convert import CLIP, InputError, check, clip, convert, decode
from rayapp.inference.client import GenerateRequest
from rayapp.types import Resource, SamplingParams, StoppingCriteria, TaskConfig


class Kind(enum.Enum):
    LOCAL = "local"
    DOCKER = "docker"


class Inner(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    share: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    amount: Annotated[float, msgspec.Meta(ge=0, le=sys.float_info.max)] = 0.0

    def __post_init__(self) -> None:
        if self.n == 13:
            raise ValueError("$.n: 13 is unlucky")


class Doc(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    backend: Literal["hf", "sglang"] = "hf"
    kind: Kind = Kind.LOCAL
    inner: Inner = Inner()
    items: list[Inner] = []
    by_name: dict[str, Inner] = {}


@pytest.mark.parametrize(("value", "message"), [
    ({}, "src: $.name: missing required field"),
    ({"name": 3}, "src: $.name: expected str, got 3"),
    ({"name": "a", "extra": 1}, 'src: $: unknown field "extra" (expected name, backend, kind, inner, items, by_name)'),
    ({"name": "a", "inner": {"m": 1}}, 'src: $.inner: unknown field "m" (expected n, share, amount)'),
    ({"name": "a", "backend": "vllm"}, 'src: $.backend: expected "hf" or "sglang", got "vllm"'),
    ({"name": "a", "kind": "k8s"}, 'src: $.kind: expected "local" or "docker", got "k8s"'),
    ({"name": "a", "inner": {"n": 0}}, "src: $.inner.n: expected int >= 1, got 0"),
    ({"name": "a", "inner": {"n": True}}, "src: $.inner.n: expected int, got true"),
    ({"name": "a", "inner": {"share": 1.5}}, "src: $.inner.share: expected float > 0 and <= 1, got 1.5"),
    ({"name": "a", "inner": {"amount": float("inf")}}, "src: $.inner.amount: expected finite float >= 0, got inf"),
    ({"name": "a", "inner": {"amount": float("nan")}}, "src: $.inner.amount: expected finite float >= 0, got nan"),
    ({"name": "a", "inner": {"amount": 10**400}},
     "src: $.inner.amount: expected finite float >= 0, got a very large integer"),
    ({"name": "a", "items": [{}, {"n": -1}]}, "src: $.items[1].n: expected int >= 1, got -1"),
    ({"name": "a", "items": [{"n": 13}]}, "src: $.items[0].n: 13 is unlucky"),
    ({"name": "a", "items": {"n": 1}}, "src: $.items: expected array, got an object"),
    ({"name": "a", "by_name": {1: {}}}, "src: $.by_name: expected str key, got 1"),
    ({"name": "a", "by_name": {"x": {"n": 0}}}, "src: $.by_name[...].n: expected int >= 1"),
    ([1, 2], "src: $: expected object, got an array of 2 items"),
])
def test_convert_names_source_path_and_value(value: Any, message: str) -> None:
    with pytest.raises(InputError) as info:
        convert(value, Doc, "src")
    assert str(info.value) == message


def test_root_places_a_piece_and_error_keeps_the_callers_class() -> None:
    class RecipeError(InputError):
        pass

    with pytest.raises(RecipeError) as info:
        convert({"n": 0}, Inner, 'recipe "r.yaml"', root="$.evaluators[2]", error=RecipeError)
    assert str(info.value) == 'recipe "r.yaml": $.evaluators[2].n: expected int >= 1, got 0'
    assert (info.value.source, info.value.path, info.value.reason) == (
        'recipe "r.yaml"', "$.evaluators[2].n", "expected int >= 1, got 0")


def test_errors_pickle_as_they_cross_ray_calls() -> None:
    from rayapp.core.cascade import CascadeError
    from rayapp.core.layout import LayoutError
    from rayapp.envs.datasets import DatasetError

    for cls in (InputError, CascadeError, LayoutError, DatasetError):
        e = pickle.loads(pickle.dumps(cls("src", "$.a", "why")))
        assert type(e) is cls and str(e) == "src: $.a: why" and e.path == "$.a"


def test_decode_json_and_msgpack() -> None:
    assert decode(b'{"name": "a", "kind": "docker"}', Doc, "f").kind is Kind.DOCKER
    assert decode(msgspec.msgpack.encode({"name": "b"}), Doc, "f", fmt="msgpack").name == "b"
    with pytest.raises(InputError) as info:
        decode(b'{"name": "a", "items": [{"share": 0}]}', Doc, "f.json")
    assert str(info.value) == "f.json: $.items[0].share: expected float > 0 and <= 1, got 0"
    with pytest.raises(InputError) as info:
        decode(b'{"name": ', Doc, "f.json")
    assert str(info.value) == "f.json: malformed JSON: input data was truncated"
    with pytest.raises(InputError, match=r"^f\.bin: malformed msgpack: "):
        decode(b"\xc1", Doc, "f.bin", fmt="msgpack")


def test_check_puts_a_struct_built_in_code_through_its_bounds() -> None:
    good = GenerateRequest([1, 2], SamplingParams(temperature=0.5))
    assert check(good, "req") == good
    with pytest.raises(InputError) as info:
        check(GenerateRequest([1], SamplingParams(temperature="hot")), "req")  # constructors do not type-check
    assert str(info.value) == 'req: $.sampling.temperature: expected float | null, got "hot"'
    with pytest.raises(InputError) as info:
        check(GenerateRequest([1], stop_token_ids=[object()]), "req")  # not data at all
    assert info.value.path == "$" and "object" in info.value.reason


@pytest.mark.parametrize(("type_", "value", "message"), [
    (Resource, {"gpu": -0.5}, "r: $.gpu: expected finite float >= 0, got -0.5"),
    (Resource, {"concurrency": -1}, "r: $.concurrency: expected int >= 0 and <= 100000, got -1"),
    (StoppingCriteria, {"max_turns": 0}, "r: $.max_turns: expected int >= 1 and <= 1000000, got 0"),
    (StoppingCriteria, {"timeout_s": 0}, "r: $.timeout_s: expected float > 0 and <= 604800, got 0"),
    (SamplingParams, {"top_k": 0}, "r: $.top_k: expected -1 (off) or int >= 1, got 0"),
    (SamplingParams, {"stop": ["ok", ""]}, 'r: $.stop[1]: expected str of length >= 1, got ""'),
    (TaskConfig, {"task_type": "t", "n_samples": 0}, "r: $.n_samples: expected int >= 1 and <= 1000000, got 0"),
])
def test_the_shared_types_carry_their_bounds(type_: type, value: dict, message: str) -> None:
    with pytest.raises(InputError) as info:
        convert(value, type_, "r")
    assert str(info.value) == message


def test_accepted_edges_stay_accepted() -> None:
    assert convert({"concurrency": 0}, Resource, "r").concurrency == 0  # 0: not counted against a budget
    assert convert({"top_k": -1, "temperature": 0}, SamplingParams, "r").top_k == -1
    assert convert({"gpu": 4, "cpu": 0}, Resource, "r").gpu == 4.0


_data = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["name", "backend", "kind", "inner", "items", "by_name", "n", "share", "x"]) | st.integers(),
        inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=_data)
def test_anything_converts_or_raises_one_input_error(value: Any) -> None:
    try:
        convert(value, Doc, "src")
    except InputError as e:
        assert str(e).startswith("src: ")


def test_a_long_source_path_or_key_is_cut_with_a_marker() -> None:
    key = "k" * 200_000
    with pytest.raises(InputError) as info:
        convert({"n": 0}, Inner, "s" * 200_000, root="$." + key)
    e = info.value
    assert len(str(e)) < 1_000
    assert e.source == "s" * CLIP + f"...({200_000 - CLIP} more characters)"
    assert e.path == "$." + "k" * (CLIP - 2) + f"...({200_004 - CLIP} more characters)"
    assert clip("short") == "short" and pickle.loads(pickle.dumps(e)).args == e.args
