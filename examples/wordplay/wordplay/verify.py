"""The verifier: ``score`` 1.0 when the reply's last word is the label (case aside), and
``mentions`` 1.0 when the label appears anywhere in the reply (a softer signal to log)."""

from __future__ import annotations

import re

from rayapp import AgentResult, Sample


def verify(sample: Sample, result: AgentResult) -> dict[str, float]:
    answer = str(sample.label).lower()
    words = re.findall(r"[A-Za-z]+", result.response or "")
    return {"score": 1.0 if words and words[-1].lower() == answer else 0.0,
            "mentions": 1.0 if answer in (result.response or "").lower() else 0.0}
