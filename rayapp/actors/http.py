"""The manager's HTTP errors: one JSON shape, ``{"status", "error", "message"}``, with a status
that says what went wrong:

- 422: bad input (a step id out of range: FastAPI's own validation answer; a ``ValueError``);
- 404: nothing there (no such step asked for, a recipe without eval datasets);
- 409: a conflicting request (another step of the same kind in flight);
- 503: a part is unavailable (an engine or the pool lost, unreachable or too slow to answer, a step
  cancelled);
- 500: anything else, with the error's class and message.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from rayapp.actors.remote import is_lost
from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.core.convert import clip
from rayapp.core.termination import EngineConnectionError

_ERROR_BODY = {"application/json": {"example": {"status": 503, "error": "EngineConnectionError",
                                                "message": "engine student unreachable: ..."}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": why, "content": _ERROR_BODY} for code, why in (
        (404, "no such step was asked for, or the recipe has none of that kind"),
        (409, "another step of that kind is in flight"),
        (500, "the step failed: the error's class and message"),
        (503, "an engine or the pool is unavailable, or the step was cancelled"))}


def error_response(status: int, error: str, message: str) -> JSONResponse:
    return JSONResponse({"status": status, "error": error, "message": clip(message, 2000)}, status_code=status)


def exception_response(error: BaseException) -> JSONResponse:
    if isinstance(error, EngineConnectionError | TimeoutError) or is_lost(error):
        status = 503
    elif isinstance(error, ValueError):
        status = 422
    else:
        status = 500
    return error_response(status, type(error).__name__, str(error))


def summary(result: RolloutResult | EvalResult) -> dict[str, Any]:
    """What a poll of a finished step answers: its size and metrics, not its samples."""
    if isinstance(result, EvalResult):
        return {"samples": sum(len(s) for s in result.samples.values()), "metrics": result.metrics,
                "artifacts": result.artifacts}
    samples = [s for g in result.groups for s in g]
    return {"groups": len(result.groups), "samples": len(samples), "metrics": result.metrics,
            "mean_score": sum(s.reward.get("score", 0.0) for s in samples) / max(1, len(samples)),
            "artifacts": result.artifacts}
