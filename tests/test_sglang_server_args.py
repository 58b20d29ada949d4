"""The recipe check's list of sglang options reads ServerArgs whatever its kind: a dataclass before
sglang 0.5.23, a msgspec Struct since (``dataclasses.fields`` raised TypeError on it, failing every
sglang recipe where sglang is installed; the SGLang lane's serve run found it)."""

import dataclasses
import sys
import types

import msgspec
import pytest

from rayapp.recipe.limits import _server_args


@pytest.fixture
def server_args_module(monkeypatch):
    def install(cls):
        for name in ("sglang", "sglang.srt"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        module = types.ModuleType("sglang.srt.server_args")
        module.ServerArgs = cls
        monkeypatch.setitem(sys.modules, "sglang.srt.server_args", module)
    return install


def test_a_msgspec_struct_server_args_gives_its_fields(server_args_module):
    server_args_module(msgspec.defstruct("ServerArgs", [("model_path", str), ("max_total_tokens", int, 0)]))
    assert _server_args() == ("model_path", "max_total_tokens")


def test_a_dataclass_server_args_gives_its_fields(server_args_module):
    server_args_module(dataclasses.make_dataclass("ServerArgs", [("model_path", str), ("tp_size", int)]))
    assert _server_args() == ("model_path", "tp_size")


def test_anything_else_leaves_the_options_unchecked(server_args_module):
    server_args_module(object)
    assert _server_args() == ()
