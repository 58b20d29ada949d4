"""Who may call the gateway for which episode: one base URL and one API key per running sample.

``EpisodeKeys.open`` gives an episode its id and a fresh key (``secrets``: 256 bits, URL-safe); the
agent's client sends the key as ``Authorization: Bearer <key>``. ``check`` answers every call with
the episode or OpenAI's error for it: 404 for an id never opened, 401 for a wrong or missing key
(compared in constant time, so a key cannot be guessed byte by byte from response times), 410 for an
episode that has ended (its sample is back with the trainer: nothing may be added to it). An ended
episode's id is remembered (bounded, oldest first) only to answer 410 instead of 404.

Pure: no Ray, no HTTP server.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict

from rayapp.gateway.openai_api import ApiError

ENDED_KEPT = 65536  # ended ids remembered for a 410; older ones answer 404


class EpisodeKeys:
    def __init__(self, ended_kept: int = ENDED_KEPT) -> None:
        self._keys: dict[str, str] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ended_kept = ended_kept

    def open(self, episode_id: str) -> str:
        """A new key for ``episode_id`` (an id in use or ended is refused: ids are never reused)."""
        if not isinstance(episode_id, str) or not episode_id or len(episode_id) > 256 or "/" in episode_id:
            raise ValueError(f"episode id {episode_id!r}: expected 1-256 characters without '/'")
        if episode_id in self._keys or episode_id in self._ended:
            raise ValueError(f"episode id {episode_id!r} is already in use or has ended")
        key = self._keys[episode_id] = secrets.token_urlsafe(32)
        return key

    def close(self, episode_id: str) -> None:
        """The episode ended: its key stops working at once (410 from now on)."""
        if self._keys.pop(episode_id, None) is not None:
            self._ended[episode_id] = None
            while len(self._ended) > self._ended_kept:
                self._ended.popitem(last=False)

    def check(self, episode_id: str, authorization: str | None) -> None:
        """Nothing when ``authorization`` (the header's value) carries ``episode_id``'s key; else the
        ApiError to answer with."""
        key = self._keys.get(episode_id)
        if key is None:
            if episode_id in self._ended:
                raise ApiError(410, f"episode {episode_id!r} has ended; its sample is final", code="episode_ended")
            raise ApiError(404, f"no episode {episode_id[:256]!r} is running here", code="episode_not_found")
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "incorrect API key for this episode (send the key its base URL came with as "
                                "'Authorization: Bearer <key>')", code="invalid_api_key")

    def __len__(self) -> int:
        return len(self._keys)
