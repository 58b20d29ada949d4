"""The hf engine's prefix cache: a multi-turn episode's next turn prefills only what is new, and
generates exactly what it would without the cache."""

import asyncio

import pytest
from safetensors.torch import load_file, save_file

from rayapp.inference import GenerateRequest
from rayapp.inference.hf import HFBackend
from rayapp.inference.prefix_cache import PrefixCache
from rayapp.types import SamplingParams


class KV:  # the two calls the cache makes of a transformers Cache
    def __init__(self, n):
        self.n = n

    def get_seq_length(self):
        return self.n

    def crop(self, n):  # transformers' meaning: a negative n drops that many tokens
        assert n < 0
        self.n += n


def test_take_hands_over_the_longest_prefix_at_the_version_and_leaves_one_token_to_run():
    cache = PrefixCache(max_entries=3, max_tokens=100)
    cache.put([1, 2, 3, 9], KV(3), version=0)  # its KV covers 3 of the 4 ids
    cache.put([1, 2, 3, 4, 5], KV(5), version=0)
    cache.put([1, 2, 3, 4, 5, 6], KV(6), version=1)
    assert cache.take([7, 8], 0) is None  # no shared prefix
    kv, n = cache.take([1, 2, 3, 4, 5, 6, 7], 0)  # version 1's longer entry is not the weights in use
    assert n == 5 and kv.n == 5 and cache.stats()["entries"] == 2  # handed over: out of the cache
    kv, n = cache.take([1, 2, 3], 0)  # all 3 covered: cut to 2, so the prompt's last token runs
    assert n == 2 and kv.n == 2
    # a cut is a copy: the entry stays whole for its own conversation's next turn
    kv, n = cache.take([1, 2, 3], 0)
    assert n == 2 and kv.n == 2 and cache.stats()["entries"] == 2
    kv, n = cache.take([1, 2, 3, 9, 10], 0)
    assert n == 4 - 1 and kv.n == 3 and cache.stats()["entries"] == 1  # it covered 3 of its 4 ids: all taken
    assert cache.take([7, 8], 0) is None
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["reused_tokens"]) == (4, 2, 12)


def test_bounds_drop_the_least_recently_kept_and_clear_empties():
    cache = PrefixCache(max_entries=2, max_tokens=10)
    for i in range(3):
        cache.put([i] * 4, KV(4), 0)
    assert cache.stats()["entries"] == 2 and cache.take([0] * 5, 0) is None  # the first went
    cache.put([7] * 11, KV(11), 0)  # more than the whole budget: not kept
    cache.put([8] * 6, KV(6), 0)  # 4 + 4 + 6 > 10: the oldest goes
    assert cache.stats() | {"hits": 0, "misses": 0} == {"entries": 2, "tokens": 10, "hits": 0, "misses": 0,
                                                        "reused_tokens": 0}
    cache.clear()
    assert cache.stats()["entries"] == cache.stats()["tokens"] == 0
    with pytest.raises(ValueError, match="bounds"):
        PrefixCache(max_entries=-1)


def episode(backend, tok, turns=4):
    """A conversation of ``turns`` greedy turns, each prompt the whole history so far (as the agents
    send it): the outputs, log-probs and prompt lengths of every turn."""
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = []
    for t in range(turns):
        got = asyncio.run(backend.generate(GenerateRequest(
            input_ids=list(ids), sampling=SamplingParams(temperature=0, max_new_tokens=12))))
        out.append((list(got.output_ids), list(got.logprobs)))
        env = tok.encode(f"\nuser: and {t} more?\nassistant:", add_special_tokens=False)
        ids = list(ids) + list(got.output_ids) + env
    return out


def test_turns_reuse_the_previous_turns_cache_and_generate_the_same(model_dir, tok, tmp_path):
    cached, plain = HFBackend(str(model_dir), seed=0), HFBackend(str(model_dir), seed=0, prefix_cache=0)
    try:
        with_cache, without = episode(cached, tok), episode(plain, tok)
        stats = asyncio.run(cached.health())["prefix_cache"]
        assert stats["hits"] == 3 and stats["reused_tokens"] > 0
        assert asyncio.run(plain.health())["prefix_cache"]["hits"] == 0
        for (ids_a, lp_a), (ids_b, lp_b) in zip(with_cache, without, strict=True):
            assert ids_a == ids_b
            assert max(abs(a - b) for a, b in zip(lp_a, lp_b, strict=True)) < 1e-4
        # new weights: what the old ones computed is not reused
        weights = load_file(str(model_dir / "model.safetensors"))
        save_file({k: v.clone() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
        asyncio.run(cached.update_weights_from_disk(str(tmp_path)))
        assert asyncio.run(cached.health())["prefix_cache"]["entries"] == 0
    finally:
        cached.shutdown()
        plain.shutdown()
