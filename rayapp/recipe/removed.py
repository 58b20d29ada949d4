"""Recipe keys whose mode left the product (issue 31, one way to do each thing): an old recipe that
still sets one is refused with the key's JSON path and what happens now, rather than msgspec's bare
"unknown field"."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# (section, key) -> what the product does now, and what to write instead
REMOVED: dict[tuple[str, str], str] = {
    ("scheduler", "release"): (
        "removed: a batch always gives each sample's placement back as soon as no sample of it can use it "
        "(what release: early did; batch_end, holding it to the batch's end, is gone); delete the key"),
    ("pool", "work"): (
        "removed: a sample's function calls (verifiers, tools) always run on warm hosts in its bundle "
        "(what work: hosts did; tasks, a Ray task per call, is gone); delete the key"),
}


def removed_keys(args: Any) -> Iterator[tuple[str, str]]:
    """Each removed key ``args`` still sets, as (JSON path, reason)."""
    if not isinstance(args, dict):
        return
    for (section, key), reason in REMOVED.items():
        value = args.get(section)
        if isinstance(value, dict) and key in value:
            yield f"$.{section}.{key}", f"{key}: {value[key]!r} {reason}"
