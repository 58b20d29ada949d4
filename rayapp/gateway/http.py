"""The agent gateway over HTTP: a ``Reply`` as a Starlette response, and the FastAPI routes that serve
a ``Gateway`` (the manager mounts them on its Serve ingress; tests serve them with uvicorn).

The routes authenticate with the episode's own key (``Authorization: Bearer <key>``), never the
manager's admin token: an agent must not hold that one.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from rayapp.gateway.openai_api import ApiError
from rayapp.gateway.service import Gateway, Reply

__all__ = ["MAX_BODY_BYTES", "gateway_response", "gateway_router", "reply_response"]

MAX_BODY_BYTES = 32 << 20  # a whole conversation fits; a body past it is refused before it is read whole


def reply_response(reply: Reply) -> Response:
    """JSON (OpenAI's shape or its error shape), or Server-Sent Events for a streamed reply."""
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(reply.body, status_code=reply.status)


async def gateway_response(gateway: Gateway, episode: str, route: str, request: Request) -> Response:
    """One gateway route answered: what a manager's route method returns."""
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            error = ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="request_too_large")
            return JSONResponse(error.body(), status_code=413)
    return reply_response(await gateway.handle(episode, route, request.headers.get("authorization"), bytes(body)))


def gateway_router(gateway: Gateway) -> APIRouter:
    """The three routes under ``/gateway/{episode}/v1`` (include it under the app's prefix)."""
    router = APIRouter()

    @router.post("/gateway/{episode}/v1/chat/completions")
    async def chat(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "chat/completions", request)

    @router.post("/gateway/{episode}/v1/completions")
    async def completions(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "completions", request)

    @router.get("/gateway/{episode}/v1/models")
    async def models(episode: str, request: Request) -> Response:
        return await gateway_response(gateway, episode, "models", request)

    return router
