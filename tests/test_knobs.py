"""docs/knobs.md is generated from the code; it must match, and name every variable the code reads."""

import re
from pathlib import Path

import rayapp
from rayapp.knobs import render

ROOT = Path(__file__).resolve().parents[1]


def test_the_knob_reference_matches_the_code():
    assert (ROOT / "docs" / "knobs.md").read_text() == render(), (
        "docs/knobs.md is stale: regenerate it with `python -m rayapp.knobs > docs/knobs.md`")


def test_every_variable_and_flag_the_package_names_is_in_the_reference():
    page = render()
    source = "\n".join(p.read_text() for p in Path(rayapp.__file__).parent.rglob("*.py")
                       if "swe_repos" not in p.parts)
    names = set(re.findall(r"\b(?:STACX|RAYAPP)_[A-Z0-9_]+\b", source))
    flags = set(re.findall(r"--dagger-[a-z-]+\b", source))
    assert names and flags
    missing = sorted(n for n in names | flags if f"`{n}`" not in page)
    assert not missing, f"not in docs/knobs.md: {missing}"


def test_code_set_variables_are_marked_never_to_set_by_hand():
    page = render()
    for name in ["STACX_DAGGER_BETA", "STACX_DAGGER_T_MAX", "STACX_ROLLOUT_ID"]:
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}`"))
        assert "code-set" in row
