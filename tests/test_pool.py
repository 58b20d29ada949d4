"""PlacementPool ledger (docs/scheduler.md §3): packing, best fit, greedy node choice, all-or-nothing, release
validation and bad input. Waiting and reservations: test_pool_reservations.py; the stateful model
check: test_pool_model.py."""

from __future__ import annotations

import asyncio
import math
import sys

import msgspec
import pytest
from pool_helpers import BIG, node, placed, pool_of, req, take

from rayapp.core.pool import PoolError, budget_tokens
from rayapp.types import Resource, Token

# ---- packing and placement ------------------------------------------------------------------------


def test_fractional_packing_three_per_gpu_then_next_gpu():
    pool = pool_of(a=node(2))
    tokens = take(pool, Resource(gpu=0.33), 4)
    assert placed(tokens) == [("a", (0,))] * 3 + [("a", (1,))]
    assert all(t.gpu == 0.33 for t in tokens)
    assert pool.snapshot()["a"]["gpu_units"] == {0: 10_000, 1: 670_000}


def test_best_fit_prefers_used_gpu_that_fits():
    pool = pool_of(a=node(3))
    assert placed(take(pool, Resource(gpu=0.5))) == [("a", (0,))]
    assert placed(take(pool, Resource(gpu=0.7))) == [("a", (1,))]  # 0.5 left on gpu 0 does not fit
    # gpu0 has 0.5 free, gpu1 0.3, gpu2 1.0: the tightest fit wins, never the fresh GPU.
    assert placed(take(pool, Resource(gpu=0.25))) == [("a", (1,))]
    assert placed(take(pool, Resource(gpu=0.4))) == [("a", (0,))]
    assert placed(take(pool, Resource(gpu=0.05))) == [("a", (1,))]
    assert pool.snapshot()["a"]["gpu_units"] == {0: 100_000, 1: 0, 2: 1_000_000}


def test_node_with_most_free_gpu_is_chosen_and_tokens_spread_across_nodes():
    pool = pool_of(small=node(2), big=node(4))
    assert placed(take(pool, Resource(gpu=1))) == [("big", (0,))]
    pool = pool_of(a=node(1), b=node(1))
    tokens = take(pool, Resource(gpu=0.25), 4)
    assert [t.node for t in tokens] == ["a", "b", "a", "b"]  # equal free GPU: layout order, then spread


def test_ties_break_on_cpu_then_memory_then_layout_order():
    pool = pool_of(a=node(1, cpu=8), b=node(1, cpu=16))
    assert take(pool, Resource(gpu=0.1))[0].node == "b"
    pool = pool_of(a=node(1, memory_gb=8), b=node(1, memory_gb=16))
    assert take(pool, Resource(gpu=0.1))[0].node == "b"


def test_skips_nodes_where_the_token_does_not_fit():
    # "a" has the most free GPU but too little CPU; a fragmented node cannot hold a share either.
    pool = pool_of(a=node(4, cpu=1), b=node(2, cpu=8))
    assert take(pool, Resource(gpu=0.5, cpu=2))[0].node == "b"
    pool = pool_of(a=node(3), b=node(1))
    take(pool, Resource(gpu=0.8), 3)  # a: 0.2 free on each of 3 GPUs (0.6 total) vs b: 1.0
    take(pool, Resource(gpu=0.5))  # -> b (most free), b has 0.5 left, a 0.6 in slivers
    assert take(pool, Resource(gpu=0.3))[0].node == "b"


def test_gpu_zero_gates_on_cpu_and_memory_only():
    pool = pool_of(a=node(0, cpu=8, memory_gb=32))
    tokens = take(pool, Resource(gpu=0, cpu=4, memory_gb=8), 2)
    assert all(t.gpu_ids == () and t.gpu == 0.0 for t in tokens)
    assert pool.try_acquire_batch(BIG, Resource(cpu=1), 1) is None  # cpu spent
    pool = pool_of(a=node(0, cpu=100, memory_gb=10))
    assert len(take(pool, Resource(cpu=1, memory_gb=4), 2)) == 2
    assert pool.try_acquire_batch(BIG, Resource(cpu=1, memory_gb=4), 1) is None  # memory spent


def test_whole_gpu_tokens_take_k_completely_free_gpus_on_one_node():
    pool = pool_of(a=node(4))
    tokens = take(pool, Resource(gpu=2), 2)
    assert placed(tokens) == [("a", (0, 1)), ("a", (2, 3))]
    assert all(t.gpu == 1.0 for t in tokens)
    pool = pool_of(a=node(3), b=node(1))
    take(pool, Resource(gpu=0.1))  # a's gpu 0 is no longer whole
    assert placed(take(pool, Resource(gpu=2))) == [("a", (1, 2))]
    assert pool.try_acquire_batch(BIG, Resource(gpu=2), 1) is None  # 1 whole GPU on b, 0.9 on a


def test_all_or_nothing_rolls_back_and_returns_none():
    pool = pool_of(a=node(1), b=node(1))
    take(pool, Resource(gpu=0.5))
    before = pool.snapshot()
    assert pool.try_acquire_batch(BIG, Resource(gpu=0.5), 4) is None  # 3 fit, the 4th does not
    assert pool.snapshot() == before and pool.held == 1
    assert len(take(pool, Resource(gpu=0.5), 3)) == 3


def test_zero_tokens_and_budget_sizing():
    pool = pool_of(a=node(2))
    assert pool.try_acquire_batch(Resource(gpu=0.0), Resource(gpu=0.5), 10) == []
    assert pool.try_acquire_batch(BIG, Resource(gpu=0.5), 0) == []
    assert len(pool.try_acquire_batch(Resource(gpu=0.99, concurrency=9), Resource(gpu=0.33), 10)) == 3
    assert pool.held == 3


def test_release_everything_restores_the_exact_initial_state():
    pool = pool_of(a=node(4, cpu=7.3, memory_gb=9.9), b=node(2, cpu=3, memory_gb=5))
    initial = pool.snapshot()
    held = []
    for gpu in (0.33, 0.1, 0.7, 1, 2, 0):
        got = pool.try_acquire_batch(BIG, Resource(gpu=gpu, cpu=0.3, memory_gb=0.7), 2)
        held += got or []
    assert pool.snapshot() != initial
    pool.release(held[::2])
    pool.release(held[1::2])
    assert pool.snapshot() == initial and pool.held == 0


def test_token_ids_are_unique_and_increasing():
    pool = pool_of(a=node(2))
    ids = [t.token_id for t in take(pool, Resource(gpu=0.25), 5) + take(pool, Resource(gpu=0.25), 3)]
    assert ids == sorted(set(ids))


# ---- budget_tokens and capacity_for ---------------------------------------------------------------


def test_budget_tokens_examples():
    assert budget_tokens(Resource(gpu=0.99, concurrency=10), Resource(gpu=0.33)) == 3
    assert budget_tokens(Resource(gpu=0.99), Resource(gpu=0.33)) == 1  # concurrency 1 caps it
    assert budget_tokens(Resource(gpu=4, concurrency=2), Resource(gpu=0.5)) == 2  # concurrency cap
    assert (
        budget_tokens(Resource(gpu=0, concurrency=4, cpu=96, memory_gb=320), Resource(cpu=4, memory_gb=16))
        == 4
    )
    assert (
        budget_tokens(Resource(concurrency=100, cpu=96, memory_gb=320), Resource(cpu=4, memory_gb=16)) == 20
    )
    assert budget_tokens(Resource(gpu=5, concurrency=9), Resource(gpu=2)) == 2
    assert budget_tokens(Resource(gpu=0.5, concurrency=9), Resource(gpu=1)) == 0
    assert budget_tokens(Resource(), Resource(concurrency=0)) == sys.maxsize


def test_max_tokens_for_examples():
    pool = pool_of(a=node(4, cpu=8, memory_gb=64), b=node(4, cpu=8, memory_gb=64))
    assert pool.capacity_for(Resource(gpu=0.33)) == 2 * 4 * 3
    assert pool.capacity_for(Resource(gpu=0.33, cpu=3)) == 2 * 2  # cpu-bound: 8 // 3 per node
    assert pool.capacity_for(Resource(gpu=0.1, memory_gb=10)) == 2 * 6  # memory-bound
    assert pool.capacity_for(Resource(gpu=0, cpu=1)) == 16
    assert pool.capacity_for(Resource(gpu=3)) == 2  # floor(4 / 3) per node
    assert pool.capacity_for(Resource(gpu=1)) == 8
    assert pool.capacity_for(Resource()) == sys.maxsize
    take(pool, Resource(gpu=1), 8)
    assert pool.capacity_for(Resource(gpu=1)) == 8  # from capacity, not from what is free
    assert pool_of(a=node(0)).capacity_for(Resource(gpu=0.5)) == 0


# ---- bad input ------------------------------------------------------------------------------------


def test_bad_release_raises_and_changes_nothing():
    pool = pool_of(a=node(2))
    tokens = take(pool, Resource(gpu=0.5), 3)
    before = pool.snapshot()
    fake = Token(999, "a", (1,), 0.5, 0.0, 0.0)
    with pytest.raises(PoolError, match="999"):
        pool.release([tokens[0], fake])
    forged = msgspec.structs.replace(tokens[1], gpu_ids=(1,))
    with pytest.raises(PoolError, match="differs"):
        pool.release([tokens[0], forged])
    with pytest.raises(PoolError, match="twice"):
        pool.release([tokens[0], tokens[0]])
    assert pool.snapshot() == before and pool.held == 3
    pool.release(tokens[:1])
    with pytest.raises(PoolError, match="already released"):  # double release
        pool.release(tokens[:2])
    assert pool.held == 2
    pool.release([])
    pool.release(iter(tokens[1:]))
    assert pool.held == 0


@pytest.mark.parametrize(
    ("per_sample", "max_tokens", "field"),
    [
        (Resource(gpu=-0.5), 1, "per_sample.gpu"),
        (Resource(gpu=float("nan")), 1, "per_sample.gpu"),
        (Resource(gpu=1.5), 1, "per_sample.gpu"),
        (Resource(gpu=math.inf), 1, "per_sample.gpu"),
        (Resource(cpu=float("nan")), 1, "per_sample.cpu"),
        (Resource(memory_gb=-1), 1, "per_sample.memory_gb"),
        (Resource(concurrency=-1), 1, "per_sample.concurrency"),
        (Resource(gpu=0.5), -1, "max_tokens"),
        (Resource(gpu=0.5), 1.5, "max_tokens"),
        (Resource(concurrency=0), sys.maxsize, "max_tokens"),
    ],
)
def test_bad_requests_name_the_field_and_change_nothing(per_sample, max_tokens, field):
    pool = pool_of(a=node(2))
    take(pool, Resource(gpu=0.5))
    before = pool.snapshot()
    with pytest.raises(PoolError, match=field.replace(".", r"\.")):
        pool.try_acquire_batch(BIG, per_sample, max_tokens)
    with pytest.raises(PoolError, match=field.replace(".", r"\.")):
        asyncio.run(pool.acquire_batch(req(per_sample, max_tokens, timeout_s=1)))
    assert pool.snapshot() == before and pool.held == 1 and pool.waiting == 0


def test_bad_budget():
    # (Layouts are checked once, by the layout parser: tests/test_layout.py.)
    with pytest.raises(PoolError, match=r"budget\.cpu"):
        budget_tokens(Resource(cpu=-1), Resource(cpu=1))
    with pytest.raises(PoolError, match=r"budget\.gpu"):
        budget_tokens(Resource(gpu=float("nan")), Resource(gpu=1))


def test_a_bad_timeout_names_the_field_and_changes_nothing():
    pool = pool_of(a=node(1))
    for bad in (-1, float("nan"), "5", True):
        with pytest.raises(PoolError, match="timeout_s"):
            asyncio.run(pool.acquire_batch(req(Resource(gpu=1), 1, timeout_s=bad)))
    assert pool.held == 0 and pool.waiting == 0
