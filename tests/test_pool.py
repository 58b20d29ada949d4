"""PlacementPool ledger (spec §3): packing, best fit, greedy node choice, all-or-nothing, release
validation, waiting (wake-up, timeout, cancellation, FIFO) and a stateful model check."""

from __future__ import annotations

import asyncio
import math
import sys
import threading

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rayapp.core.pool import PlacementPool, PoolError, budget_tokens
from rayapp.types import NodeSpec, Resource, Token

BIG = Resource(gpu=math.inf, concurrency=1000, cpu=math.inf, memory_gb=math.inf)


def pool_of(**nodes: NodeSpec) -> PlacementPool:
    return PlacementPool(dict(nodes))


def node(n_gpus: int = 0, cpu: float = 64, memory_gb: float = 256) -> NodeSpec:
    return NodeSpec(gpus=tuple(range(n_gpus)), cpu=cpu, memory_gb=memory_gb)


def take(pool: PlacementPool, per_sample: Resource, n: int = 1) -> list[Token]:
    tokens = pool.try_acquire_batch(BIG, per_sample, n)
    assert tokens is not None and len(tokens) == n
    return tokens


def placed(tokens: list[Token]) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.node, t.gpu_ids) for t in tokens]


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
        asyncio.run(pool.acquire_batch(BIG, per_sample, max_tokens, timeout=1))
    assert pool.snapshot() == before and pool.held == 1 and pool.waiting == 0


def test_bad_budget_and_layouts():
    with pytest.raises(PoolError, match=r"budget\.cpu"):
        budget_tokens(Resource(cpu=-1), Resource(cpu=1))
    with pytest.raises(PoolError, match=r"budget\.gpu"):
        budget_tokens(Resource(gpu=float("nan")), Resource(gpu=1))
    with pytest.raises(PoolError, match="layout"):
        PlacementPool({})
    with pytest.raises(PoolError, match=r"layout\['a'\]\.gpus"):
        PlacementPool({"a": NodeSpec(gpus=(0, 0))})
    with pytest.raises(PoolError, match=r"layout\['a'\]\.cpu"):
        PlacementPool({"a": NodeSpec(gpus=(0,), cpu=-2)})


# ---- waiting --------------------------------------------------------------------------------------


def count_tries(pool: PlacementPool) -> list[int]:
    calls = [0]
    real = pool._try

    def counted(*args):
        calls[0] += 1
        return real(*args)

    pool._try = counted
    return calls


def test_waiter_is_admitted_by_a_release_not_by_polling():
    async def main():
        pool = pool_of(a=node(1))
        holder = take(pool, Resource(gpu=1))
        tries = count_tries(pool)
        events: list[str] = []

        async def wait():
            got = await pool.acquire_batch(BIG, Resource(gpu=0.5), 2, timeout=3600)
            events.append("admitted")
            return got

        task = asyncio.create_task(wait())
        await asyncio.sleep(0.05)  # a poller would have retried many times by now
        assert not task.done() and tries[0] == 1 and pool.waiting == 1
        events.append("released")
        await pool.release_batch(holder)
        got = await asyncio.wait_for(task, 3600)
        assert events == ["released", "admitted"] and tries[0] == 2
        assert placed(got) == [("a", (0,)), ("a", (0,))] and pool.waiting == 0

    asyncio.run(main())


def test_release_from_another_thread_wakes_the_waiter():
    async def main():
        pool = pool_of(a=node(1))
        holder = take(pool, Resource(gpu=1))
        task = asyncio.create_task(pool.acquire_batch(BIG, Resource(gpu=1), 1, timeout=3600))
        await asyncio.sleep(0)
        thread = threading.Thread(target=pool.release, args=(holder,))
        thread.start()
        got = await asyncio.wait_for(task, 3600)
        thread.join()
        assert len(got) == 1 and pool.held == 1

    asyncio.run(main())


def test_timeout_raises_and_holds_nothing():
    async def main():
        pool = pool_of(a=node(1))
        holder = take(pool, Resource(gpu=0.6))
        before = pool.snapshot()
        with pytest.raises(TimeoutError, match="not admitted within"):
            await pool.acquire_batch(BIG, Resource(gpu=0.5), 1, timeout=0.01)
        assert pool.snapshot() == before and pool.held == 1 and pool.waiting == 0
        pool.release(holder)
        assert len(await pool.acquire_batch(BIG, Resource(gpu=0.5), 2, timeout=0.01)) == 2

    asyncio.run(main())


def test_cancellation_holds_nothing_and_keeps_the_queue_working():
    async def main():
        pool = pool_of(a=node(2))
        holder = take(pool, Resource(gpu=1), 2)
        first = asyncio.create_task(pool.acquire_batch(BIG, Resource(gpu=1), 2))
        second = asyncio.create_task(pool.acquire_batch(BIG, Resource(gpu=1), 1))
        await asyncio.sleep(0)
        assert pool.waiting == 2
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert pool.waiting == 1 and pool.held == 2
        pool.release(holder[:1])
        assert len(await asyncio.wait_for(second, 3600)) == 1  # the new head was woken and admitted
        assert pool.held == 2 and pool.waiting == 0

    asyncio.run(main())


def test_fifo_big_waiter_is_not_starved_by_later_small_ones():
    async def main():
        pool = pool_of(a=node(4))
        holder = take(pool, Resource(gpu=1), 3)
        big = asyncio.create_task(pool.acquire_batch(BIG, Resource(gpu=1), 4))
        await asyncio.sleep(0)
        small = asyncio.create_task(pool.acquire_batch(BIG, Resource(gpu=1), 1))
        await asyncio.sleep(0.01)
        assert not small.done()  # one GPU is free, but the earlier big batch is first in line
        pool.release(holder)
        big_tokens = await asyncio.wait_for(big, 3600)
        await asyncio.sleep(0.01)
        assert len(big_tokens) == 4 and not small.done()
        pool.release(big_tokens)
        assert len(await asyncio.wait_for(small, 3600)) == 1

    asyncio.run(main())


def test_a_batch_that_can_never_fit_fails_fast():
    async def main():
        pool = pool_of(a=node(1))
        take(pool, Resource(gpu=1))
        with pytest.raises(PoolError, match="can never fit"):
            await pool.acquire_batch(BIG, Resource(gpu=0.5), 3)
        assert pool.waiting == 0

    asyncio.run(main())


# ---- stateful model check -------------------------------------------------------------------------

UNITS = (1_000_000, 1_000, 1_024)  # GPU, milli-cores, MiB


def units(x: float, scale: int) -> int:
    return max(1, round(x * scale)) if x > 0 else 0


def model_place(state: dict, order: list[str], per_sample: Resource):
    """Reference placement, the slow obvious way: scan every node, best-fit every GPU."""
    u = units(min(per_sample.gpu, 1.0), UNITS[0]) if per_sample.gpu else 0
    k = int(per_sample.gpu) if per_sample.gpu > 1 else (1 if per_sample.gpu else 0)
    cpu, mem = units(per_sample.cpu, UNITS[1]), units(per_sample.memory_gb, UNITS[2])
    best = None
    for idx, name in enumerate(order):
        s = state[name]
        if s["cpu_milli"] < cpu or s["memory_mib"] < mem:
            continue
        free = sorted((f, g) for g, f in s["gpu_units"].items() if f >= u)  # (free, gpu id) ascending
        if k > 1:
            whole = [g for g in s["gpu_units"] if s["gpu_units"][g] == UNITS[0]]
            gpus = tuple(whole[:k]) if len(whole) >= k else None
        else:
            gpus = () if k == 0 else ((free[0][1],) if free else None)
        if gpus is None:
            continue
        rank = (sum(s["gpu_units"].values()), s["cpu_milli"], s["memory_mib"], -idx)
        if best is None or rank > best[0]:
            best = (rank, name, gpus)
    if best is None:
        return None
    _, name, gpus = best
    s = state[name]
    for g in gpus:
        s["gpu_units"][g] -= u
    s["cpu_milli"] -= cpu
    s["memory_mib"] -= mem
    s["held"] += 1
    return name, gpus


node_specs = st.builds(
    lambda n, cpu, mem: NodeSpec(gpus=tuple(range(10, 10 + n)), cpu=cpu, memory_gb=mem),
    st.integers(0, 4),
    st.sampled_from([0, 2, 4.5, 16]),
    st.sampled_from([0, 8, 33.3, 128]),
)
per_samples = st.builds(
    Resource,
    gpu=st.sampled_from([0, 0.1, 0.25, 0.33, 0.5, 0.7, 1.0, 2.0, 3.0]),
    concurrency=st.sampled_from([0, 1, 1, 2]),
    cpu=st.sampled_from([0, 0.5, 1, 3]),
    memory_gb=st.sampled_from([0, 1, 4.4, 16]),
)
budgets = st.builds(
    Resource,
    gpu=st.sampled_from([0, 0.99, 2.5, 8, math.inf, math.inf]),
    concurrency=st.integers(0, 8),
    cpu=st.sampled_from([2, 10, math.inf, math.inf]),
    memory_gb=st.sampled_from([10, math.inf, math.inf]),
)


class PoolMachine(RuleBasedStateMachine):
    @initialize(layout=st.lists(node_specs, min_size=1, max_size=4))
    def build(self, layout):
        self.order = [f"n{i}" for i in range(len(layout))]
        self.spec = dict(zip(self.order, layout, strict=True))
        self.pool = PlacementPool(self.spec)
        self.initial = self.pool.snapshot()
        self.capacity = self.pool.snapshot()
        self.held: list[Token] = []
        self.released: list[Token] = []

    @rule(budget=budgets, per_sample=per_samples, max_tokens=st.integers(0, 6))
    def acquire(self, budget, per_sample, max_tokens):
        before = self.pool.snapshot()
        expected = min(budget_tokens(budget, per_sample), max_tokens)
        model = msgspec.json.decode(msgspec.json.encode(before), type=dict[str, dict])
        for s in model.values():
            s["gpu_units"] = {int(g): f for g, f in s["gpu_units"].items()}
        want = [model_place(model, self.order, per_sample) for _ in range(expected)]
        got = self.pool.try_acquire_batch(budget, per_sample, max_tokens)
        if None in want:
            assert got is None and self.pool.snapshot() == before
            return
        assert got is not None and len(got) == expected
        assert placed(got) == want  # greedy node choice and best-fit GPU, token by token
        assert self.pool.snapshot() == model
        self.held += got

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release_some(self, data):
        picked = data.draw(st.lists(st.sampled_from(self.held), unique_by=lambda t: t.token_id, min_size=1))
        self.pool.release(picked)
        ids = {t.token_id for t in picked}
        self.held = [t for t in self.held if t.token_id not in ids]
        self.released += picked

    @precondition(lambda self: self.released)
    @rule(data=st.data())
    def bad_release(self, data):
        before = self.pool.snapshot()
        stale = data.draw(st.sampled_from(self.released))
        with pytest.raises(PoolError):
            self.pool.release([*self.held, stale])
        assert self.pool.snapshot() == before

    @rule()
    def release_all(self):
        self.pool.release(self.held)
        self.released += self.held
        self.held = []
        assert self.pool.snapshot() == self.initial

    @invariant()
    def ledger_within_capacity(self):
        snap = self.pool.snapshot()
        assert self.pool.held == len(self.held) == sum(s["held"] for s in snap.values())
        for name, s in snap.items():
            cap = self.capacity[name]
            assert all(0 <= f <= cap["gpu_units"][g] for g, f in s["gpu_units"].items())
            assert 0 <= s["cpu_milli"] <= cap["cpu_milli"]
            assert 0 <= s["memory_mib"] <= cap["memory_mib"]

    def teardown(self):
        if hasattr(self, "pool"):
            self.pool.release(self.held)
            assert self.pool.snapshot() == self.initial


PoolMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_pool_state_machine = PoolMachine.TestCase
