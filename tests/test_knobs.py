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


def _recipe_rows(page: str) -> list[list[str]]:
    section = page.split("## Recipe keys", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in rows]


def test_every_recipe_key_has_a_meaning():
    rows = _recipe_rows(render())
    assert len(rows) > 50
    for row in rows:
        assert len(row) == 5, row  # key | type | default | meaning | spec flag
        assert row[3], f"recipe key {row[0]} has no meaning: give its Struct field Annotated[T, msgspec.Meta(...)]"


def test_recipe_key_types_defaults_and_dagger_meanings_come_from_the_code():
    rows = {row[0].strip("`"): row for row in _recipe_rows(render())}
    assert rows["scheduler.acquire_timeout_s"][1:3] == ["float", "`None`"]
    assert rows["pool.cluster_layout"][1:3] == ["union", "`None`"]
    assert rows["filters.rejection"][2] == "`None`" and rows["filters.abort_cap"][2] == "`{}`"
    assert rows["evaluators[].evaluator_id"][2] == "`(required)`"
    # dagger.* meanings are the --dagger-* flags' help, written once in dagger_schedule.py
    assert rows["dagger.beta_start"][3].startswith("β at iteration 0") and "(default:" not in rows["dagger.gamma"][3]
    assert rows["dagger.beta_start"][4] == "`--dagger-beta-start`"


def test_every_key_with_modes_says_who_needs_each_and_no_removed_key_is_still_read():
    """One way to do each thing (issue 31): a key with a closed set of modes has its sentence in
    ``knobs.MODES``; a removed key is no longer in the recipe's schema."""
    import msgspec

    from rayapp.knobs import MODES, _walk
    from rayapp.recipe import RecipeConfig
    from rayapp.recipe.removed import REMOVED

    rows = _walk(msgspec.inspect.type_info(RecipeConfig), "")
    with_modes = {path for path, kind, _, _ in rows if " or " in kind}
    assert with_modes == set(MODES)
    assert not {f"{section}.{key}" for section, key in REMOVED} & {path for path, *_ in rows}
