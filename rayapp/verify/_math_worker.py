"""The child process behind ``rayapp.verify.math_answers``: reads one JSON request a line on stdin, answers
``1`` or ``0`` a line on stdout. It runs math-verify with its signal-based timeouts off (the parent
kills this process instead, which also stops a hang inside C code, where no signal handler runs)."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys

# An answer is extracted from a ``\boxed{}`` first, then from any LaTeX, then from a plain expression.
_DOLLARS_OR_BOX = ("$", "\\boxed", "\\(", "\\[")


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies, so a parent killed mid-request (by
    SIGKILL, where no cleanup runs) leaves no busy child behind. Elsewhere stdin's EOF does it."""
    try:
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def check(response: str, label: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    # A bare label ("0.5", "\frac{1}{2}", "B") is read as LaTeX math, as if it were written in $...$.
    gold_text = label if any(mark in label for mark in _DOLLARS_OR_BOX) else f"${label}$"
    gold = parse(gold_text, extraction_config=config, parsing_timeout=None)
    if not gold:
        return False
    answer = parse(response, extraction_config=config, parsing_timeout=None)
    return bool(answer) and bool(verify(gold, answer, timeout_seconds=None))


def main() -> None:
    _die_with_parent()
    # The protocol keeps its own copy of stdout; fd 1 then points at stderr, so a library that prints
    # (a warning, a progress line) cannot garble an answer.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.disable(logging.WARNING)  # math-verify warns that its timeouts are off: they are, on purpose
    import math_verify  # noqa: F401  (paid once, before "ready", not inside the first request's timeout)

    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            ok = check(str(request["response"]), str(request["label"]))
        except Exception:  # a malformed answer is a wrong answer, never a dead verifier
            ok = False
        out.write("1\n" if ok else "0\n")
        out.flush()


if __name__ == "__main__":
    main()
