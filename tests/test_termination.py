
import pytest

from rayapp.core.termination import (
    AbortReason,
    AgentTimeout,
    EngineConnectionError,
    EpisodeError,
    FailureClass,
    SandboxError,
    classify_abort,
    classify_termination,
)
from rayapp.record import TerminationReason


class RemoteError(Exception):
    """Stands for a wrapper a remote call raises around the original error."""


def wrapped(inner):
    try:
        raise inner
    except Exception as e:
        try:
            raise RemoteError("task failed") from e
        except RemoteError as outer:
            return outer


@pytest.mark.parametrize(("error", "expected"), [
    (TimeoutError(), AbortReason.AGENT_TIMEOUT),
    (TimeoutError(), AbortReason.AGENT_TIMEOUT),
    (AgentTimeout("turn 3"), AbortReason.AGENT_TIMEOUT),
    (ConnectionRefusedError(111, "refused"), AbortReason.INFRA_CONN),
    (EngineConnectionError("engine gone"), AbortReason.INFRA_CONN),
    (SandboxError("exit 1"), AbortReason.INFRA_SANDBOX),
    (MemoryError(), AbortReason.INFRA_SANDBOX),
    (ValueError("bad shape"), AbortReason.INFRA_OTHER),
    (EpisodeError("generic"), AbortReason.INFRA_OTHER),
    # type wins over a misleading message
    (SandboxError("connection timed out"), AbortReason.INFRA_SANDBOX),
    (TimeoutError("connection refused"), AbortReason.AGENT_TIMEOUT),
    # the cause chain of a wrapper is read
    (wrapped(SandboxError("oom")), AbortReason.INFRA_SANDBOX),
    (wrapped(ConnectionResetError()), AbortReason.INFRA_CONN),
    # message second, for errors that lost their type
    (RuntimeError("Request timed out after 30s"), AbortReason.AGENT_TIMEOUT),
    (RuntimeError("Cannot connect to host 127.0.0.1:30000"), AbortReason.INFRA_CONN),
    (RuntimeError("container exited with code 137 (OOMKilled)"), AbortReason.INFRA_SANDBOX),
    (RuntimeError("The actor died unexpectedly"), AbortReason.INFRA_CONN),
    ("ECONNREFUSED", AbortReason.INFRA_CONN),
    ("deadline exceeded", AbortReason.AGENT_TIMEOUT),
    ("something odd", AbortReason.INFRA_OTHER),
])
def test_classify_abort(error, expected):
    assert classify_abort(error) is expected


def test_a_self_referencing_cause_chain_terminates():
    e = RuntimeError("x")
    e.__cause__ = e
    assert classify_abort(e) is AbortReason.INFRA_OTHER


def test_an_error_met_while_handling_a_timeout_is_classed_by_itself():
    """The implicit context is what was being handled, not the cause: a sandbox OOM raised inside
    ``except TimeoutError`` is a sandbox fault, an untyped error there is read by its message."""
    def raised_while_handling_timeout(error):
        try:
            try:
                raise TimeoutError("turn 2")
            except TimeoutError:
                raise error  # noqa: B904 - the implicit context is what this test is about
        except Exception as e:
            return e

    assert classify_abort(raised_while_handling_timeout(RuntimeError("sandbox out of memory"))) \
        is AbortReason.INFRA_SANDBOX
    assert classify_abort(raised_while_handling_timeout(ValueError("bad reply"))) is AbortReason.INFRA_OTHER
    explicit = raised_while_handling_timeout(RuntimeError("wrapped"))
    explicit.__cause__ = explicit.__context__
    assert classify_abort(explicit) is AbortReason.AGENT_TIMEOUT


@pytest.mark.parametrize(("reward", "reason", "expected"), [
    ({"score": 1.0}, "stop", FailureClass.SUCCESS),
    ({"score": 1.0}, "max_turns", FailureClass.SUCCESS),  # solved wins over the limit
    ({"score": 0.5}, "max_turns", FailureClass.MAX_TURNS),  # partial credit is not solved
    ({"score": 0.5}, "stop", FailureClass.WRONG_ANSWER),
    ({"score": 0.0}, "stop", FailureClass.WRONG_ANSWER),
    ({"score": -1.0}, None, FailureClass.WRONG_ANSWER),
    ({"score": 0.0}, "max_turns", FailureClass.MAX_TURNS),
    ({"score": 0.0}, "max_context_len", FailureClass.MAX_CONTEXT),
    ({"score": 0.0}, "length", FailureClass.MAX_CONTEXT),
    ({"score": 0.0}, TerminationReason.MAX_CONTEXT_LEN, FailureClass.MAX_CONTEXT),  # the enum reads as its value
    ({"score": 0.0}, "max_context", FailureClass.WRONG_ANSWER),  # a failure class, not a reason any agent gives
    ({"score": 0.0}, AbortReason.INFRA_CONN, FailureClass.INFRA_CONN),
    ({"score": 0.0}, "agent_timeout", FailureClass.AGENT_TIMEOUT),
    ({"score": 0.0}, "infra_conn", FailureClass.INFRA_CONN),
    ({"score": 0.0}, "infra_sandbox", FailureClass.INFRA_SANDBOX),
    ({"score": 0.0}, "infra_other", FailureClass.INFRA_OTHER),
    ({"score": 1.0}, "infra_other", FailureClass.INFRA_OTHER),  # an abort is never a success
    ({}, None, FailureClass.WRONG_ANSWER),
    (1.0, "stop", FailureClass.SUCCESS),
    (None, None, FailureClass.WRONG_ANSWER),
])
def test_classify_termination(reward, reason, expected):
    assert classify_termination(reward, reason) is expected


def test_there_are_eight_failure_classes():
    assert len(FailureClass) == 8
    assert {r.value for r in AbortReason} <= {f.value for f in FailureClass}
