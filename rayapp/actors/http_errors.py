"""The manager's HTTP errors: one JSON shape, ``{"status", "error", "message"}``, with a status
that says what went wrong:

- 422: bad input (a step id that is not a canonical decimal integer in 0 .. 2**31-1; a ``ValueError``);
- 401 / 403: no or a wrong token, or no token configured off loopback (``rayapp.actors.http_auth``);
- 404: nothing there (no such step asked for, a recipe without eval datasets);
- 409: a conflicting request (another step of the same kind in flight);
- 503: a part is unavailable (an engine or the pool lost, unreachable or too slow to answer, a step
  cancelled);
- 500: anything else, with the error's class and message.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from fastapi.responses import JSONResponse

from rayapp.actors.remote import is_lost
from rayapp.core.contracts import EvalResult, RolloutResult
from rayapp.core.convert import clip
from rayapp.core.termination import EngineConnectionError
from rayapp.steps.results import MAX_STEP_ID

# One spelling per id: no sign, no spaces, no leading zeros, no fraction (int() would take "+5", " 1").
_STEP_ID = re.compile(r"0|[1-9][0-9]{0,9}")

_ERROR_BODY = {"application/json": {"example": {"status": 503, "error": "EngineConnectionError",
                                                "message": "engine student unreachable: ..."}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": why, "content": _ERROR_BODY} for code, why in (
        (401, "no token, or another one: the route needs Authorization: Bearer <token>"),
        (403, "no token is configured and Serve's proxy does not listen on loopback"),
        (404, "no such step was asked for, or the recipe has none of that kind"),
        (409, "another step of that kind is in flight"),
        (422, "the step id is not a decimal integer in 0 .. 2**31-1 (no sign, spaces or leading zeros)"),
        (500, "the step failed: the error's class and message"),
        (503, "an engine or the pool is unavailable, or the step was cancelled"))}


def parse_step_id(raw: str) -> int:
    """A step id from a URL path: the canonical decimal spelling of an int in 0 .. MAX_STEP_ID, else one
    ValueError naming it (the route answers 422 and nothing starts)."""
    if not isinstance(raw, str) or not _STEP_ID.fullmatch(raw) or int(raw) > MAX_STEP_ID:
        raise ValueError(f"step id {clip(repr(raw), 40)} in the URL path: must be a decimal integer in 0 .. "
                         f"{MAX_STEP_ID}, written without sign, spaces or leading zeros")
    return int(raw)


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


def gateway_base_url(host: str | None, port: int, route_prefix: str | None) -> str:
    """Where an agent in the manager's process reaches the agent gateway: Serve's HTTP proxy at
    ``host``:``port`` (the loopback address when it listens on loopback or on every interface) under
    the app's ``route_prefix``. An app served without a route has no gateway: ValueError."""
    if route_prefix is None:
        raise ValueError("the rayapp application has no route_prefix, so its agent gateway has no URL: give the "
                         "application a route_prefix (e.g. /rayapp) to run gateway agents")
    try:
        ip = ipaddress.ip_address(host or "")
    except ValueError:  # a host name: as it is (localhost: loopback)
        ip = None
    if ip is None:
        host = "127.0.0.1" if host in (None, "", "localhost") else host
    elif ip.is_loopback or ip.is_unspecified:
        host = "127.0.0.1" if ip.version == 4 else "[::1]"
    elif ip.version == 6:
        host = f"[{host}]"
    return f"http://{host}:{port}{route_prefix.rstrip('/')}/gateway"
