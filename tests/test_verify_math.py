"""Math rewards through math-verify: the probes a hand-written normaliser got wrong, negatives that
must stay negative, and a worker process that a hanging answer cannot outlive or block."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from rayapp.types import AgentResult, Sample
from rayapp.verify import math_answers as vmath
from rayapp.verify.math_answers import MathVerifier

TOWER = r"The answer is \boxed{2^{2^{2^{2^{2^{2}}}}}}"  # sympy evaluates this for ever


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(max_workers=2) as v:
        yield v


def _dead(pid: int) -> bool:
    """Gone or a zombie: a process that runs no more."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1:2] == ["Z"] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


def _wait_dead(pid: int, limit_s: float = 20.0) -> bool:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if _dead(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("response,label", [
    (r"So the answer is $\frac{1}{2}$.", "0.5"),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{0.5}", r"\dfrac{1}{2}"),
    (r"The answer is \boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"The answer is \boxed{(1, 2)}", "(1, 2)"),
    (r"The answer is \boxed{\text{(B)}}", "B"),
    (r"Therefore $\boxed{-7}$.", "-7"),
    (r"\boxed{1,234}", "1234"),
    ("The answer is 19.", "19"),
    ("Some work: 2 + 2 = 4. The answer is -96,829,398.", "-96829398"),
    ("reasoning 5 6\n#### 42", "42"),
    ("The final answer is: **-15**", "-15"),
    ("It drops to \u22123 degrees.", "-3"),  # a typographic minus
    ("Answer: 12.0", 12),  # a numeric label
])
def test_the_stated_answer_is_found_equal(verifier, response, label):
    assert verifier.verify(response, label) is True


@pytest.mark.parametrize("response,label", [
    ("The answer is 7.", "-7"),
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{\sqrt{3}}", r"\sqrt{2}"),
    (r"\boxed{(2, 1)}", "(1, 2)"),
    (r"\boxed{\text{(C)}}", "B"),
    ("The answer is 190.", "19"),
    ("I don't know", "19"),
    ("", "19"),
])
def test_a_wrong_or_missing_answer_is_false(verifier, response, label):
    assert verifier.verify(response, label) is False


def test_a_hanging_answer_is_false_its_worker_killed_and_the_next_call_served(verifier):
    before = verifier.timeouts
    assert verifier.verify(TOWER, "5", timeout_s=1.0) is False
    assert verifier.timeouts == before + 1
    pids = verifier.worker_pids()
    assert verifier.verify(r"\boxed{\frac{1}{2}}", "0.5") is True  # a fresh worker, if the old one went
    assert all(not _dead(pid) for pid in verifier.worker_pids())
    assert len(verifier.worker_pids()) <= 2 and set(pids) <= set(verifier.worker_pids())


def test_the_killed_worker_is_reaped():
    with MathVerifier(max_workers=1) as v:
        assert v.verify("42", "42") is True
        (pid,) = v.worker_pids()
        assert v.verify(TOWER, "5", timeout_s=1.0) is False
        assert _dead(pid) and v.worker_pids() == []


def test_a_worker_that_dies_mid_request_scores_false_and_is_replaced():
    with MathVerifier(max_workers=1) as v:
        assert v.verify("1", "1") is True
        (pid,) = v.worker_pids()
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        assert v.verify(TOWER, "5", timeout_s=60.0) is False
        assert v.timeouts == 1
        assert v.verify("3", "3") is True and v.worker_pids() != [pid]


def test_the_async_call_leaves_the_event_loop_free():
    async def main():
        task = asyncio.create_task(vmath.verify_math_async(TOWER, "5", timeout_s=2.0))
        await asyncio.sleep(0.1)  # the loop runs other coroutines while the verifier works
        running = not task.done()
        return running, await task

    running, verdict = asyncio.run(main())
    assert running and verdict is False


def test_concurrent_callers_each_get_their_own_verdict():
    cases = [(f"The answer is {i}.", str(i if i % 2 else i + 1)) for i in range(12)]
    verdicts: dict[int, bool] = {}
    with MathVerifier(max_workers=2) as v:
        threads = [threading.Thread(target=lambda i=i, c=c: verdicts.__setitem__(i, v.verify(*c)))
                   for i, c in enumerate(cases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(v.worker_pids()) <= 2
    assert verdicts == {i: bool(i % 2) for i in range(12)}


def test_close_kills_every_worker_and_refuses_later_calls():
    v = MathVerifier(max_workers=2)
    assert v.verify("1", "1") is True
    pids = v.worker_pids()
    v.close()
    assert pids and all(_dead(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        v.verify("1", "1")


def test_a_worker_dies_with_its_parent(tmp_path):
    """A parent killed by SIGKILL runs no cleanup: the worker must still go (Linux parent-death signal)."""
    script = (
        "import sys, threading\n"
        "from rayapp.verify.math_answers import MathVerifier\n"
        "v = MathVerifier(max_workers=1)\n"
        "assert v.verify('1', '1')\n"
        "print(v.worker_pids()[0], flush=True)\n"
        f"v.verify({TOWER!r}, '5', timeout_s=600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        worker_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    assert _wait_dead(worker_pid)


def test_bad_arguments_and_a_missing_package_are_clear(monkeypatch, verifier):
    with pytest.raises(ValueError, match="timeout_s"):
        verifier.verify("1", "1", timeout_s=0)
    with pytest.raises(ValueError, match="max_workers"):
        MathVerifier(max_workers=0)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "math_verify" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install math-verify"):
        MathVerifier()


def test_the_env_verifier_scores_the_response_against_the_label():
    def sample(label):
        return Sample("t", 0, "q", label=label)

    def result(text):
        return AgentResult(tokens=[], response_length=0, response=text)

    assert vmath.verify(sample("0.5"), result(r"\boxed{\frac{1}{2}}")) == {"score": 1.0}
    assert vmath.verify(sample(19), result("The answer is 18.")) == {"score": 0.0}
    assert vmath.verify(sample("19"), result(None)) == {"score": 0.0}


def test_close_during_a_call_scores_that_call_false_and_reaps_its_worker():
    v = MathVerifier(max_workers=1)
    assert v.verify("1", "1") is True
    (pid,) = v.worker_pids()
    threading.Timer(0.5, v.close).start()
    assert v.verify(TOWER, "5", timeout_s=60.0) is False
    assert _dead(pid) and v.worker_pids() == []
