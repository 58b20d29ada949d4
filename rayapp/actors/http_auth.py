"""Who may use the manager's HTTP routes (docs/security.md).

Ray's token authentication covers Ray's own servers, not Serve's HTTP proxy: a route that starts a
step is open to whoever reaches the proxy. So:

- With a token configured (``RAYAPP_HTTP_TOKEN``, or ``RAYAPP_HTTP_TOKEN_FILE`` naming a file that
  holds it: a Kubernetes Secret as an environment variable or a mounted file; set in the replica's
  environment or in the recipe's ``runtime_env.env_vars``, never the token itself in a repository),
  every route but ``/healthz`` needs ``Authorization: Bearer <token>``: 401 without it or with
  another token.
- Without one, the routes are served only while Serve's proxy listens on a loopback address
  (``http_options.host: 127.0.0.1``, every shipped recipe): on any other host each route but
  ``/healthz`` answers 403 naming the variables to set. Nothing starts in either case.

``/healthz`` stays open (probes carry no token); ``/docs`` and ``/openapi.json`` (FastAPI's) describe
the routes and hold no state.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from fastapi.responses import JSONResponse

from rayapp.actors.http import error_response

TOKEN_ENV = "RAYAPP_HTTP_TOKEN"
TOKEN_FILE_ENV = "RAYAPP_HTTP_TOKEN_FILE"
MIN_TOKEN_CHARS = 16
MAX_TOKEN_BYTES = 4096


def is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or 0.0.0.0's like: not provably this machine only
        return False


def load_token(env: Mapping[str, str]) -> str | None:
    """The configured token, or None; a configured one that is unusable is one ValueError naming it."""
    if env.get(TOKEN_ENV) and env.get(TOKEN_FILE_ENV):
        raise ValueError(f"set one of {TOKEN_ENV} and {TOKEN_FILE_ENV}, not both")
    if env.get(TOKEN_FILE_ENV):
        where = f"{TOKEN_FILE_ENV}={env[TOKEN_FILE_ENV]}"
        raw = _read_regular_file(Path(env[TOKEN_FILE_ENV]), where)
    elif env.get(TOKEN_ENV):
        raw, where = env[TOKEN_ENV].encode(), TOKEN_ENV
    else:
        return None
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ValueError(f"{where}: the token must be ASCII text") from None
    if not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_BYTES or any(c.isspace() for c in token):
        raise ValueError(f"{where}: the token must be {MIN_TOKEN_CHARS} to {MAX_TOKEN_BYTES} characters without "
                         f"spaces (e.g. `openssl rand -hex 32`)")
    return token


def _read_regular_file(path: Path, where: str) -> bytes:
    """Its first bytes; a FIFO or a device is refused before any read could block the replica
    (a Kubernetes Secret's file is a link to a regular file: links are followed)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ValueError(f"{where}: not a readable regular file ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{where}: not a readable regular file")
        return os.read(fd, MAX_TOKEN_BYTES + 1)
    finally:
        os.close(fd)


class HttpGuard:
    """The decision for one request: None (serve it) or the refusal to answer."""

    def __init__(self, token: str | None):
        self._token = token.encode() if token is not None else None

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def refusal(self, authorization: str | None, proxy_host: str | None) -> JSONResponse | None:
        """``authorization``: the request's header; ``proxy_host``: where Serve's proxy listens (None: unknown).
        The routes that stay open (``/healthz``) do not ask."""
        if self._token is None:
            if is_loopback(proxy_host):
                return None
            return error_response(403, "Forbidden", f"Serve's HTTP proxy listens on {proxy_host or 'an unknown host'}, "
                                  f"not loopback, and no token is configured: set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
                                  "in the manager's environment (docs/security.md)")
        scheme, _, presented = (authorization or "").partition(" ")
        # compare_digest: the time taken does not tell how much of a guess was right
        if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), self._token):
            answer = error_response(401, "Unauthorized", "this route needs the header Authorization: Bearer <token> "
                                    f"with the token of {TOKEN_ENV} / {TOKEN_FILE_ENV}")
            answer.headers["WWW-Authenticate"] = "Bearer"
            return answer
        return None
