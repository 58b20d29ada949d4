"""PlacementPool stateful model check: random layouts, acquires (the ledger's, and batches through a
reservation hook that refuses, raises or hangs at random), releases good and bad (whole batches, and
tokens given back early, one batch's at a time), owners released;
placement compared token by token with a slow obvious model, and the ledger's invariants checked
after every step."""

from __future__ import annotations

import asyncio
import math

import msgspec
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pool_helpers import HookError, ScriptedHook, placed

from rayapp.core.pool import PlacementPool, PoolError, budget_tokens
from rayapp.types import BatchRequest, NodeSpec, Resource, Token

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
        if s["cordoned"] or s["cpu_milli"] < cpu or s["memory_mib"] < mem:
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


class PoolModel(RuleBasedStateMachine):
    @initialize(layout=st.lists(node_specs, min_size=1, max_size=4))
    def build(self, layout):
        self.order = [f"n{i}" for i in range(len(layout))]
        self.spec = dict(zip(self.order, layout, strict=True))
        self.hook = ScriptedHook()
        self.pool = PlacementPool(self.spec, self.hook, retry_s=0)
        self.initial = self.pool.snapshot()
        self.capacity = self.pool.snapshot()
        self.held: list[Token] = []  # from try_acquire_batch
        self.released: list[Token] = []
        # name -> (owner, tokens granted, tokens still held), from acquire_batch
        self.batches: dict[str, tuple[str, list[Token], list[Token]]] = {}

    def expect(self, budget, per_sample, max_tokens):
        """The model's placement of the request from the current state, and the state after it."""
        expected = min(budget_tokens(budget, per_sample), max_tokens)
        model = msgspec.json.decode(msgspec.json.encode(self.pool.snapshot()), type=dict[str, dict])
        for s in model.values():
            s["gpu_units"] = {int(g): f for g, f in s["gpu_units"].items()}
        return [model_place(model, self.order, per_sample) for _ in range(expected)], model

    @rule(budget=budgets, per_sample=per_samples, max_tokens=st.integers(0, 6))
    def acquire(self, budget, per_sample, max_tokens):
        before = self.pool.snapshot()
        want, model = self.expect(budget, per_sample, max_tokens)
        got = self.pool.try_acquire_batch(budget, per_sample, max_tokens)
        if None in want:
            assert got is None and self.pool.snapshot() == before
            return
        assert got is not None and len(got) == len(want)
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

    @rule(budget=budgets, per_sample=per_samples, max_tokens=st.integers(0, 6), owner=st.sampled_from(["m1", "m2"]),
          script=st.lists(st.sampled_from(["none", "none", "raise", "hang"]), max_size=3))
    def acquire_batch(self, budget, per_sample, max_tokens, owner, script):
        """Through the hook, which answers ``script`` first: refusals retry at once (retry_s=0), an
        error fails the acquire, a hang runs into its timeout; each leaves the ledger as it was."""
        before = self.pool.snapshot()
        want, model = self.expect(budget, per_sample, max_tokens)
        if len(want) > self.pool.capacity_for(per_sample):
            return  # can never fit: a PoolError up front (tests/test_pool_reservations.py)
        fits = None not in want
        decisive = next((s for s in script if s != "none"), "ok") if fits and want else "ok"
        self.hook.script = list(script)
        timeout = 0 if not fits else 0.01 if decisive == "hang" else None
        request = BatchRequest(budget, per_sample, max_tokens, label="b", owner=owner, timeout_s=timeout)
        error = {"ok": None, "raise": HookError, "hang": TimeoutError}[decisive] if fits else TimeoutError
        event(f"acquire_batch: {decisive if fits else 'no room'}, {script.count('none')} refusals scripted")
        if error is not None:
            with pytest.raises(error):
                asyncio.run(self.pool.acquire_batch(request))
            assert self.pool.snapshot() == before and self.hook.pending == 0
            return
        got = asyncio.run(self.pool.acquire_batch(request))
        assert placed(got) == want and self.pool.snapshot() == model
        if got:
            assert len({t.placement_group for t in got}) == 1 and [t.bundle_index for t in got] == list(range(len(got)))
            self.batches[got[0].placement_group] = (owner, got, list(got))

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def release_batch(self, data):
        name = data.draw(st.sampled_from(sorted(self.batches)))
        _, tokens, _ = self.batches[name]
        if len(tokens) > 1 and data.draw(st.booleans()):
            before = self.pool.snapshot()
            with pytest.raises(PoolError, match="released whole"):
                asyncio.run(self.pool.release_batch(tokens[1:]))
            assert self.pool.snapshot() == before
            return
        asyncio.run(self.pool.release_batch(tokens))
        del self.batches[name]

    @precondition(lambda self: any(held for _, _, held in self.batches.values()))
    @rule(data=st.data())
    def release_early(self, data):
        """Some of one batch's tokens go back before the batch ends: their capacity is free at once."""
        name = data.draw(st.sampled_from(sorted(n for n, (_, _, held) in self.batches.items() if held)))
        owner, granted, held = self.batches[name]
        picked = data.draw(st.lists(st.sampled_from(held), unique_by=lambda t: t.token_id, min_size=1))
        before = self.pool.snapshot()
        asyncio.run(self.pool.release_tokens(picked))
        after = self.pool.snapshot()
        assert sum(s["held"] for s in before.values()) - sum(s["held"] for s in after.values()) == len(picked)
        self.batches[name] = (owner, granted, [t for t in held if t not in picked])

    @precondition(lambda self: any(len(held) < len(granted) for _, granted, held in self.batches.values()))
    @rule(data=st.data())
    def bad_early_release(self, data):
        """A token given back twice, or tokens of two batches at once: refused, nothing changes."""
        name = data.draw(st.sampled_from(sorted(n for n, (_, g, h) in self.batches.items() if len(h) < len(g))))
        _, granted, held = self.batches[name]
        gone = next(t for t in granted if t not in held)
        others = [t for n, (_, _, h) in self.batches.items() if n != name for t in h]
        mixed = [*held[:1], *others[:1]] if held and others else [gone]
        bad = data.draw(st.sampled_from([[gone], [*held, gone], mixed]))
        before = self.pool.snapshot()
        with pytest.raises(PoolError, match="release_tokens"):
            asyncio.run(self.pool.release_tokens(bad))
        assert self.pool.snapshot() == before

    @rule(data=st.data(), on=st.booleans())
    def cordon(self, data, on):
        """A node's reservation is lost (or back): placement skips it, capacity and the free view leave
        it out, and nothing it holds changes."""
        node = data.draw(st.sampled_from(self.order))
        before = self.pool.snapshot()
        was = before[node]["cordoned"]
        assert (self.pool.cordon(node) if on else self.pool.uncordon(node)) == (was != on)
        after = self.pool.snapshot()
        assert after[node]["cordoned"] is on
        assert {n: {**s, "cordoned": None} for n, s in after.items()} == {
            n: {**s, "cordoned": None} for n, s in before.items()}
        assert set(self.pool.free()) == {n for n, s in after.items() if not s["cordoned"]}
        with pytest.raises(PoolError, match="no node"):
            self.pool.cordon("nowhere")

    @rule(owner=st.sampled_from(["m1", "m2"]))
    def release_owner(self, owner):
        mine = [n for n, (o, _, _) in self.batches.items() if o == owner]
        assert asyncio.run(self.pool.release_owner(owner)) == len(mine)
        for n in mine:
            del self.batches[n]

    @rule()
    def release_all(self):
        self.pool.release(self.held)
        self.released += self.held
        self.held = []
        for owner in ("m1", "m2"):
            asyncio.run(self.pool.release_owner(owner))
        self.batches = {}
        for node in self.order:
            self.pool.uncordon(node)
        assert self.pool.snapshot() == self.initial

    @invariant()
    def ledger_within_capacity(self):
        snap = self.pool.snapshot()
        in_batches = [t for _, _, held in self.batches.values() for t in held]
        assert self.pool.held == len(self.held) + len(in_batches) == sum(s["held"] for s in snap.values())
        assert self.hook.held == {t.token_id: t for t in in_batches}  # the hook holds exactly the live batches
        assert {b.name: list(b.tokens) for b in self.pool.batches()} == {n: h for n, (_, _, h) in self.batches.items()}
        assert self.pool.waiting == 0
        for name, s in snap.items():
            cap = self.capacity[name]
            assert all(0 <= f <= cap["gpu_units"][g] for g, f in s["gpu_units"].items())
            assert 0 <= s["cpu_milli"] <= cap["cpu_milli"]
            assert 0 <= s["memory_mib"] <= cap["memory_mib"]

    @invariant()
    def capacity_leaves_cordoned_nodes_out(self):
        """capacity_for is the sum over the nodes not cordoned of what each holds alone."""
        snap = self.pool.snapshot()
        for per_sample in (Resource(gpu=0.25, cpu=0.5), Resource(gpu=2.0), Resource(cpu=1, memory_gb=1)):
            alone = [PlacementPool({n: self.spec[n]}).capacity_for(per_sample) for n in self.order
                     if not snap[n]["cordoned"]]
            assert self.pool.capacity_for(per_sample) == sum(alone)

    def teardown(self):
        if hasattr(self, "pool"):
            self.release_all()
            assert not self.hook.held


PoolModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_pool_model = PoolModel.TestCase
