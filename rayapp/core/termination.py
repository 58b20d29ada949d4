"""Why an episode ended (docs/scheduler.md §4): abort classification and the eight failure classes.

``classify_abort`` maps an exception raised inside an episode to one transport class. It reads the
exception's type first (the exception types below, builtin timeouts and connection errors, and
their explicit causes), then its message, so wrapped or stringified errors from remote processes still
classify. ``classify_termination`` folds a finished sample's reward and reason (an agent's
``TerminationReason`` or an ``AbortReason``) into one of the eight ``FailureClass`` values that
summaries count.
"""

from __future__ import annotations

import enum
import re

from rayapp.record import AbortReason, TerminationReason

__all__ = ["SOLVED_SCORE", "AbortReason", "AgentTimeout", "EngineConnectionError", "EpisodeError", "FailureClass",
           "SandboxError", "classify_abort", "classify_termination", "is_solved"]


class FailureClass(enum.StrEnum):
    """One class per sample. The first two are the episode's own outcome; the next two are the
    agent's limits; the last four are aborts."""

    SUCCESS = "success"  # solved (``is_solved``)
    WRONG_ANSWER = "wrong_answer"  # finished on its own, not solved
    MAX_TURNS = "max_turns"  # stopped by StoppingCriteria.max_turns
    MAX_CONTEXT = "max_context"  # stopped by max_context_len or a length cut (the class, not a reason)
    AGENT_TIMEOUT = "agent_timeout"
    INFRA_CONN = "infra_conn"
    INFRA_SANDBOX = "infra_sandbox"
    INFRA_OTHER = "infra_other"


class EpisodeError(Exception):
    """Base of the errors that agents, sandboxes and engine clients raise on purpose."""

    reason: AbortReason = AbortReason.INFRA_OTHER


class AgentTimeout(EpisodeError):
    reason = AbortReason.AGENT_TIMEOUT


class EngineConnectionError(EpisodeError):
    reason = AbortReason.INFRA_CONN


class SandboxError(EpisodeError):
    reason = AbortReason.INFRA_SANDBOX


class AgentOutputError(EpisodeError, ValueError):
    """An agent's result or reward outside its bounds: infra_other, whatever words its message holds
    (a reward key named "timeout_penalty" is no timeout)."""


# Message patterns, most specific first: a message naming a sandbox OOM is a sandbox fault even
# when it also says "killed after timeout".
_MESSAGE_RULES: list[tuple[re.Pattern[str], AbortReason]] = [
    (re.compile(r"sandbox|container|docker|out of memory|\boom\b|oomkilled|sigkill|exit code 137", re.I),
     AbortReason.INFRA_SANDBOX),
    (re.compile(r"timed? ?out|timeout|deadline exceeded", re.I), AbortReason.AGENT_TIMEOUT),
    (re.compile(r"connection|connect |econnrefused|unreachable|broken pipe|remote end closed|"
                r"actor (?:died|unavailable)|replica|service unavailable|\b50[234]\b", re.I),
     AbortReason.INFRA_CONN),
]

# Types checked in order; subclasses before their bases (TimeoutError is an OSError).
# asyncio.TimeoutError is TimeoutError on Python 3.11+.
_TYPE_RULES: list[tuple[type[BaseException], AbortReason]] = [
    (TimeoutError, AbortReason.AGENT_TIMEOUT),
    (ConnectionError, AbortReason.INFRA_CONN),
    (MemoryError, AbortReason.INFRA_SANDBOX),
]


def _by_type(exc: BaseException) -> AbortReason | None:
    if isinstance(exc, AgentOutputError):
        return AbortReason.INFRA_OTHER
    if isinstance(exc, EpisodeError) and type(exc).reason is not AbortReason.INFRA_OTHER:
        return type(exc).reason
    for kind, reason in _TYPE_RULES:
        if isinstance(exc, kind):
            return reason
    return None


def classify_abort(error: BaseException | str) -> AbortReason:
    """agent_timeout / infra_conn / infra_sandbox / infra_other, by type first, message second.

    The explicit ``__cause__`` chain (``raise ... from e``) is walked for a known type, since a
    remote call re-raises the original inside its own wrapper. The implicit ``__context__`` is not:
    it names what was being handled when the error came, not what caused it (a sandbox OOM met
    inside ``except TimeoutError`` is a sandbox fault)."""
    if isinstance(error, BaseException):
        seen: set[int] = set()
        exc: BaseException | None = error
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            reason = _by_type(exc)
            if reason is not None:
                return reason
            exc = exc.__cause__
        message = f"{type(error).__name__}: {error}"
    else:
        message = error
    for pattern, reason in _MESSAGE_RULES:
        if pattern.search(message):
            return reason
    return AbortReason.INFRA_OTHER


# The one meaning of "solved" (failure classes, eval accuracy, pass@k): full credit. A partial score
# (0 < score < 1: some tests passed) is not a solved task.
SOLVED_SCORE = 1.0


def is_solved(reward: dict[str, float] | float | None) -> bool:
    """Whether a reward (the dict's ``score``, or a bare number) reaches ``SOLVED_SCORE``; a missing
    score solved nothing."""
    score = reward.get("score", 0.0) if isinstance(reward, dict) else (reward or 0.0)
    return score >= SOLVED_SCORE


_ABORTS = frozenset(AbortReason)
_LIMIT_REASONS = {
    TerminationReason.MAX_TURNS: FailureClass.MAX_TURNS,
    TerminationReason.MAX_CONTEXT_LEN: FailureClass.MAX_CONTEXT,
    TerminationReason.LENGTH: FailureClass.MAX_CONTEXT,
}


def classify_termination(reward: dict[str, float] | float | None, reason: str | None) -> FailureClass:
    """Fold a sample's (reward, termination reason) into one FailureClass.

    Aborts win (their reason is a transport class); then a solved one is a success whatever
    limit ended the episode; then the limit that stopped it; else a wrong answer. ``reason`` is
    ``Sample.episode.reason`` (or its value, as the trainer's ``_termination_reason`` holds it)."""
    if reason in _ABORTS:
        return FailureClass(reason)
    if is_solved(reward):
        return FailureClass.SUCCESS
    return _LIMIT_REASONS.get(reason or "", FailureClass.WRONG_ANSWER)
