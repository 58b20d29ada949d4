"""The calculator agent's verifier: exact match of the last integer of its answer with the label."""

from __future__ import annotations

import re


def verify(sample, result) -> dict[str, float]:
    """``result.response`` is the text the agent returned; ``sample.label`` the right answer."""
    found = re.findall(r"-?\d+", result.response)
    return {"score": 1.0 if found and found[-1] == str(sample.label) else 0.0}
