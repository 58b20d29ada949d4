"""Who may use the manager's HTTP routes (docs/security.md).

Ray's token authentication covers Ray's own servers, not Serve's HTTP proxy: a route that starts a
step is open to whoever reaches the proxy. So:

- With a token configured (``RAYAPP_HTTP_TOKEN``, or ``RAYAPP_HTTP_TOKEN_FILE`` naming a file that
  holds it: a Kubernetes Secret as an environment variable or a mounted file; set in the replica's
  environment or in the recipe's ``runtime_env.env_vars``, never the token itself in a repository),
  every route but ``/healthz`` needs ``Authorization: Bearer <token>``: 401 without it or with
  another token.
- Without one, the routes are served only while Serve's proxy listens on a loopback address
  (``http_options.host: 127.0.0.1``, every shipped recipe), and only to a caller that presents Ray's
  own cluster token (``Authorization: Bearer <token>``, the token Ray's token auth reads:
  ``RAY_AUTH_TOKEN``, else the file ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``): whoever may
  use the cluster may use its routes, and nobody else on the machine. 401 without it; 403 when the
  replica finds no such token (Ray's token auth off), naming what to set. On any other host each route
  but ``/healthz`` answers 403 naming the variables to set: Ray's token is never asked for in clear
  text across a network. Nothing starts in any refused case.

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

from rayapp.actors.http_errors import error_response

TOKEN_ENV = "RAYAPP_HTTP_TOKEN"
TOKEN_FILE_ENV = "RAYAPP_HTTP_TOKEN_FILE"
# Where Ray's token auth reads the cluster's token from (Ray's names; rayapp.cli.local_cluster sets them for a
# head of its own).
RAY_TOKEN_ENV, RAY_TOKEN_PATH_ENV, RAY_TOKEN_FILE = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", Path(".ray/auth_token")
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


def ray_cluster_token(env: Mapping[str, str], home: Path | None = None) -> str | None:
    """Ray's own cluster token, read in the order Ray's token auth reads it (``RAY_AUTH_TOKEN``, else
    the file ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``), or None when there is none this
    process can read: then no caller can present it, and the routes stay shut."""
    if env.get(RAY_TOKEN_ENV):
        token = env[RAY_TOKEN_ENV].strip()
    else:
        path = Path(env[RAY_TOKEN_PATH_ENV]) if env.get(RAY_TOKEN_PATH_ENV) else (home or Path.home()) / RAY_TOKEN_FILE
        try:
            token = _read_regular_file(path, str(path)).decode("ascii").strip()
        except (ValueError, UnicodeDecodeError):  # none here, or not one Ray could use either
            return None
    return token if MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_BYTES else None


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
    """The decision for one request: None (serve it) or the refusal to answer. ``token``: the HTTP
    token configured (``load_token``); ``ray_token``: Ray's cluster token (``ray_cluster_token``),
    what a loopback proxy's routes ask for when no HTTP token is configured."""

    def __init__(self, token: str | None, ray_token: str | None = None):
        self._token = token.encode() if token is not None else None
        self._ray_token = ray_token.encode() if ray_token is not None else None

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def refusal(self, authorization: str | None, proxy_host: str | None) -> JSONResponse | None:
        """``authorization``: the request's header; ``proxy_host``: where Serve's proxy listens (None: unknown).
        The routes that stay open (``/healthz``) do not ask."""
        if self._token is not None:
            return _bearer_refusal(authorization, self._token, f"the token of {TOKEN_ENV} / {TOKEN_FILE_ENV}")
        if not is_loopback(proxy_host):
            return error_response(403, "Forbidden", f"Serve's HTTP proxy listens on {proxy_host or 'an unknown host'}, "
                                  f"not loopback, and no token is configured: set {TOKEN_ENV} or {TOKEN_FILE_ENV} "
                                  "in the manager's environment (docs/security.md)")
        if self._ray_token is None:
            return error_response(403, "Forbidden", f"no token is configured ({TOKEN_ENV} / {TOKEN_FILE_ENV}) and "
                                  "the manager finds no Ray cluster token (Ray's token auth is off): set one, or "
                                  f"turn Ray's token auth on (RAY_AUTH_MODE=token) (docs/security.md)")
        return _bearer_refusal(authorization, self._ray_token,
                               f"Ray's cluster token ({RAY_TOKEN_ENV}, the file {RAY_TOKEN_PATH_ENV} or "
                               f"~/{RAY_TOKEN_FILE}), as no {TOKEN_ENV} is configured")


def _bearer_refusal(authorization: str | None, token: bytes, which: str) -> JSONResponse | None:
    """401 unless ``authorization`` is ``Bearer <token>``; ``which`` says which token, never its value."""
    scheme, _, presented = (authorization or "").partition(" ")
    # compare_digest: the time taken does not tell how much of a guess was right
    if scheme.lower() != "bearer" or not hmac.compare_digest(presented.strip().encode(), token):
        answer = error_response(401, "Unauthorized", f"this route needs the header Authorization: Bearer <token> "
                                f"with {which}")
        answer.headers["WWW-Authenticate"] = "Bearer"
        return answer
    return None
