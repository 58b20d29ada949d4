"""The hf engine's prefix cache: a finished request's KV cache, kept for the next request that starts
with the same tokens.

A multi-turn episode sends each turn as the whole conversation so far: the previous turn's prompt,
its output, then the environment's tokens. Without reuse every turn prefills the whole context again,
so a 10-turn episode prefills its first prompt ten times. With it, a turn prefills only what is new
since the previous turn ended (``bench/kv_reuse.py`` measures the per-turn speed-up).

- An entry is a KV cache and the tokens it covers, at the weight version that computed it; a weight
  update empties the cache (keys and values of old weights are not the new model's).
- ``take`` hands an entry over to one request, which extends it in place, so it leaves the cache: a
  longest-prefix match. When only part of the entry matches (a GRPO group's next sample starting from
  the prompt another sample's turn extended, or a prompt the entry covers whole: at least one token of
  the new prompt must run, its logits are the first sample's), the request gets a cut (``crop``) copy
  and the entry stays for the conversation it belongs to: taking it would cost that episode's next
  turn its whole context to save another's prompt.
- Bounded by entries and by the tokens they hold together, least recently used out first.
- A turn that reuses a cache generates the same tokens; its log-probs may differ from a fresh
  prefill's in the last float bits (two pieces round differently: about 1e-7 on the tiny model), as
  with any engine's prefix cache (SGLang's radix cache likewise).

All calls come from the backend's one worker thread: no locking.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any


class PrefixCache:
    def __init__(self, max_entries: int = 64, max_tokens: int = 262_144):
        if max_entries < 0 or max_tokens < 0:
            raise ValueError(f"prefix cache bounds must be >= 0, got {max_entries} entries, {max_tokens} tokens")
        self.max_entries, self.max_tokens = max_entries, max_tokens
        self._entries: OrderedDict[int, tuple[tuple[int, ...], Any, int]] = OrderedDict()  # id -> (ids, kv, version)
        self._tokens = 0
        self._next = 0
        self.hits = self.misses = self.reused_tokens = 0

    def take(self, ids: list[int], version: int) -> tuple[Any, int] | None:
        """The KV cache of the longest kept prefix of ``ids`` at ``version`` and the tokens it covers
        (fewer than ``len(ids)``), removed from the cache; None when no entry shares a prefix."""
        best, best_len = None, 0
        limit = len(ids) - 1
        for key, (covered, _, v) in self._entries.items():
            n = min(len(covered), limit)
            if v == version and n > best_len and covered[:n] == tuple(ids[:n]):
                best, best_len = key, n
        if best is None:
            self.misses += 1
            return None
        covered, kv, _ = self._entries[best]
        if len(covered) > best_len:
            self._entries.move_to_end(best)  # used: the least recently used go first
            kv = copy.deepcopy(kv)
            kv.crop(best_len - len(covered))  # negative: tokens to drop (what every transformers version takes)
        else:
            del self._entries[best]
            self._tokens -= len(covered)
        self.hits += 1
        self.reused_tokens += best_len
        return kv, best_len

    def put(self, ids: list[int], kv: Any, version: int) -> None:
        """Keep ``kv``, which covers the first ``kv.get_seq_length()`` of ``ids``."""
        n = int(kv.get_seq_length())
        if n < 1 or n > self.max_tokens or self.max_entries == 0:
            return
        self._entries[self._next] = (tuple(ids[:n]), kv, version)
        self._next += 1
        self._tokens += n
        while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
            covered, _, _ = self._entries.popitem(last=False)[1]
            self._tokens -= len(covered)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def stats(self) -> dict[str, int]:
        return {"entries": len(self._entries), "tokens": self._tokens, "hits": self.hits, "misses": self.misses,
                "reused_tokens": self.reused_tokens}
