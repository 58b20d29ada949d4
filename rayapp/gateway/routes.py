"""The agent gateway over HTTP: a ``Reply`` as a Starlette response, and the FastAPI routes that serve
a ``Gateway`` (the manager mounts them on its Serve ingress; tests serve them with uvicorn).

The routes authenticate with the episode's own key (``Authorization: Bearer <key>``), never the
manager's admin token: an agent must not hold that one. The key is checked from the headers before
the body is read, and a body is read only up to the episode's bound (``Gateway.admit``; at most
``MAX_BODY_BYTES``): a caller without the key, or a body no context of the episode could hold, is
refused without the manager holding it.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rayapp.gateway.openai_api import ApiError
from rayapp.gateway.service import Gateway, Reply

__all__ = ["MAX_BODY_BYTES", "gateway_response", "gateway_router", "reply_response"]

MAX_BODY_BYTES = 32 << 20  # the bound of an episode without max_context_len


def reply_response(reply: Reply) -> Response:
    """JSON (OpenAI's shape or its error shape), or Server-Sent Events for a streamed reply."""
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(reply.body, status_code=reply.status)


async def gateway_response(gateway: Gateway, episode: str, route: str, request: Request) -> Response:
    """One gateway route answered: what a manager's route method returns."""
    authorization = request.headers.get("authorization")
    try:
        bound = gateway.admit(episode, authorization)
    except ApiError as e:
        return JSONResponse(e.body(), status_code=e.status)
    limit = MAX_BODY_BYTES if bound is None else min(bound, MAX_BODY_BYTES)
    too_large = ApiError(413, f"request body over {limit} bytes, more than this episode's max_context_len could hold"
                              if bound is not None and bound < MAX_BODY_BYTES else
                              f"request body over {limit} bytes", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return JSONResponse(too_large.body(), status_code=413)
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            return JSONResponse(too_large.body(), status_code=413)
    return reply_response(await gateway.handle(episode, route, authorization, bytes(body)))


def gateway_router(gateway: Gateway) -> APIRouter:
    """The four routes under ``/gateway/{episode}/v1`` (include it under the app's prefix)."""
    router = APIRouter()

    @router.post("/gateway/{episode}/v1/chat/completions")
    async def chat(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "chat/completions", request)

    @router.post("/gateway/{episode}/v1/responses")
    async def responses(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "responses", request)

    @router.post("/gateway/{episode}/v1/completions")
    async def completions(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "completions", request)

    @router.get("/gateway/{episode}/v1/models")
    async def models(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "models", request)

    return router
