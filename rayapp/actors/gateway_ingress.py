"""The agent gateway's HTTP routes (``/gateway/<episode>/v1/...``, docs/agents.md), as a FastAPI router
the manager's ingress includes, answered by the ``Gateway`` the manager holds (``rayapp.gateway``).

A router on the manager's own ingress, not a deployment of its own: each agent call is then one hop
(Serve's proxy to the replica that records the episode), where a separate gateway deployment would add
a handle call per agent request on the path ``bench/gateway.py`` measures, and would still have to
reach the manager's replica that holds the episode.

The episode's own key authenticates each call, so these routes never ask for the admin token (an agent
must never hold it). No ``from __future__ import annotations``: FastAPI must see ``Request`` itself.
"""

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rayapp.gateway.routes import gateway_response
from rayapp.gateway.service import Gateway

router = APIRouter()


class GatewayRoutes:
    """The routes as methods of the ingress class that inherits them (Serve binds them to its replica);
    that class sets ``self.gateway``."""

    gateway: Gateway

    @router.post("/gateway/{episode}/v1/chat/completions")
    async def gateway_chat(self, episode: str, request: Request) -> Response:
        return await gateway_response(self.gateway, episode, "chat/completions", request)

    @router.post("/gateway/{episode}/v1/responses")
    async def gateway_responses(self, episode: str, request: Request) -> Response:
        return await gateway_response(self.gateway, episode, "responses", request)

    @router.post("/gateway/{episode}/v1/completions")
    async def gateway_completions(self, episode: str, request: Request) -> Response:
        return await gateway_response(self.gateway, episode, "completions", request)

    @router.get("/gateway/{episode}/v1/models")
    async def gateway_models(self, episode: str, request: Request) -> Response:
        return await gateway_response(self.gateway, episode, "models", request)
