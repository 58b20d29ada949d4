"""Faults at random points against the real TaskScheduler + Evaluator + PlacementPool, on virtual time.

Agents fail, cancel themselves, raise SystemExit/KeyboardInterrupt, hang past their limit or return
garbage; their teardown takes time; callbacks raise; strategies drop or duplicate tasks; the step is
cancelled (sometimes twice) at random moments. Whatever happens:
- a step that returns has every sample exactly once, in a terminal state, and its result does not
  change afterwards; a step that raises says why (its cancellation, the callback's error, the strategy);
- no token goes back to the pool while an episode on it runs or is still tearing down;
- the pool is back to its initial snapshot, and nothing of the step runs or calls back once it ended.
"""
import asyncio
import math

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rayapp.core.batching import fifo_batching, longest_first_batching
from rayapp.core.clock import loop_time, run_virtual
from rayapp.core.layout import parse_cluster_layout
from rayapp.core.pool import PlacementPool
from rayapp.core.scheduler import SchedulerConfig, TaskScheduler
from rayapp.record import AbortReason
from rayapp.trainers.converters import trainer_metadata
from rayapp.types import AgentResult, EvaluatorSpec, Resource, Status, StoppingCriteria, Task, TaskConfig

H = 3600.0
LAYOUT = '{"n0": {"gpus": [0, 1], "cpu": 8, "memory_gb": 64}}'
TERMINAL = {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED}
RUN_FAULTS = ["ok", "raise", "cancel", "exit", "interrupt", "hang", "garbage", "swallow"]
CALLBACK_FAULTS = {"raise": lambda: RuntimeError("collector broke"),
                   "cancel": lambda: asyncio.CancelledError("the callback's own"),
                   "exit": lambda: SystemExit(2), "interrupt": KeyboardInterrupt}


class Journal:
    """Every action of the step with its loop time; ``live`` maps the token ids of episodes that run or
    are still tearing down to their sample, and ``violations`` collects what must never happen."""

    def __init__(self):
        self.events: list[tuple[float, str]] = []
        self.live: dict[int, tuple[str, int]] = {}
        self.violations: list[str] = []

    def note(self, what):
        self.events.append((loop_time(), what))


class Chaos:
    """An agent doing what ``plan[(task_id, index)]`` says: (run fault, hours, teardown hours, verify fails)."""

    def __init__(self, plan, journal):
        self.plan, self.j = plan, journal

    async def run(self, sample, ctx):
        key = (sample.task_id, sample.index)
        fault, hours, teardown, _ = self.plan[key]
        tid = ctx.token.token_id
        if tid in self.j.live:
            self.j.violations.append(f"{key} got token {tid} while {self.j.live[tid]} still holds it")
        self.j.live[tid] = key
        self.j.note(f"start {key}")

        async def close():
            try:
                await asyncio.sleep(teardown * H)
            except asyncio.CancelledError:  # a sandbox half closed: its token must not be reused
                self.j.violations.append(f"the teardown of {key} was cut short")
                raise
            finally:
                self.j.live.pop(tid, None)
                self.j.note(f"closed {key}")

        ctx.keep("box", object(), close)
        try:
            await asyncio.sleep(hours * H)
        except asyncio.CancelledError:
            if fault != "swallow":
                raise
            self.j.note(f"swallowed the cancellation {key}")  # and goes on as if nothing happened
        self.j.note(f"ran {key}")
        if fault == "raise":
            raise RuntimeError("agent broke")
        if fault == "cancel":
            raise asyncio.CancelledError("the agent's own")
        if fault == "exit":
            raise SystemExit(1)
        if fault == "interrupt":
            raise KeyboardInterrupt
        if fault == "hang":
            await asyncio.sleep(1000 * H)
        if fault == "garbage":
            return AgentResult(tokens=[1, 2], response_length=1, rollout_log_probs=[math.nan])
        return AgentResult(tokens=[1, 2], response_length=1, rollout_log_probs=[-0.5], loss_mask=[1])

    async def evaluate(self, sample, result, ctx):
        self.j.note(f"verify {(sample.task_id, sample.index)}")
        if self.plan[(sample.task_id, sample.index)][3]:
            raise ConnectionError("verifier gone")
        return {"score": 1.0}


class WatchedPool:
    """The real PlacementPool, with every release checked against the journal's live episodes."""

    def __init__(self, pool, journal, hold=False):
        self.pool, self.j, self.hold = pool, journal, hold

    def _check(self, tokens, how):
        self.j.note(f"{how} {sorted(t.token_id for t in tokens)}")
        for t in tokens:
            if t.token_id in self.j.live:
                self.j.violations.append(f"{how} of token {t.token_id} while {self.j.live[t.token_id]} is live")

    async def acquire_batch(self, request):
        return await self.pool.acquire_batch(request)

    async def release_tokens(self, tokens):
        if self.hold:  # a pool that frees nothing before release_batch
            return
        self._check(tokens, "release_tokens")
        await self.pool.release_tokens(tokens)

    async def release_batch(self, tokens):
        self._check(tokens, "release_batch")
        await self.pool.release_batch(tokens)

    async def max_tokens_for(self, per_sample):
        return await self.pool.max_tokens_for(per_sample)


def drop_last(tasks, specs):
    return fifo_batching(tasks[:-1], specs)


def duplicate_first(tasks, specs):
    return fifo_batching([*tasks, tasks[0]], specs)


STRATEGIES = {"fifo": fifo_batching, "longest_first": longest_first_batching,
              "drop": drop_last, "duplicate": duplicate_first}

sample_plan = st.tuples(st.sampled_from(RUN_FAULTS), st.integers(0, 3), st.integers(0, 2), st.booleans())
scenario = st.fixed_dictionaries({
    "groups": st.lists(st.lists(sample_plan, min_size=1, max_size=3), min_size=1, max_size=5),
    "strategy": st.sampled_from(["fifo", "fifo", "longest_first", "drop", "duplicate"]),
    "bad_callback": st.none() | st.tuples(st.integers(0, 4), st.sampled_from([*CALLBACK_FAULTS, "hang"])),
    "complete_after": st.none() | st.integers(1, 5),
    "cancel_at": st.none() | st.floats(0, 12),
    "cancel_twice": st.booleans(),
    "concurrency": st.integers(1, 3),
    "batch_size": st.integers(1, 3),
    "release": st.sampled_from(["early", "hold"]),
})


async def ending(step, sc):
    """How the step ended, checking that a failure says why: (outcome, its result when it returned)."""
    try:
        return "done", await step
    except asyncio.CancelledError:
        return "cancelled", None
    except ValueError as e:
        assert sc["strategy"] in ("drop", "duplicate") and "batching strategy" in str(e)
        return "refused", None
    except ExceptionGroup as e:  # the callback's error, as it raised it or wrapped when it was a BaseException
        assert sc["bad_callback"] is not None
        assert e.subgroup(lambda x: isinstance(x, RuntimeError) and ("collector broke" in str(x)
                                                                     or "on_task_done" in str(x))) is not None
        return "failed", None


async def one_step(sc):
    journal = Journal()
    plan = {(f"t{i}", j): s for i, g in enumerate(sc["groups"]) for j, s in enumerate(g)}
    tasks = [Task(f"t{i}", "p", TaskConfig("x", n_samples=len(g))) for i, g in enumerate(sc["groups"])]
    core = PlacementPool(parse_cluster_layout(LAYOUT, 8, 64))
    initial = core.snapshot()
    spec = EvaluatorSpec("x", Chaos(plan, journal), batch_size=sc["batch_size"], eval_timeout_s=H,
                         resource=Resource(gpu=math.inf, concurrency=sc["concurrency"]),
                         run_resource=Resource(gpu=0.5))
    config = SchedulerConfig(rollout_batch_size=len(tasks), progress=False,
                             global_stopping=StoppingCriteria(timeout_s=20 * H))

    class Source:
        async def get_tasks(self, n):
            return list(tasks)

    async def on_done(task, samples):
        journal.note(f"callback {task.task_id}")
        bad, fault = sc["bad_callback"] or (None, None)
        if task.task_id != f"t{bad}":
            return
        if fault == "hang":
            await asyncio.sleep(500 * H)
            journal.note(f"callback {task.task_id} woke")
            return
        raise CALLBACK_FAULTS[fault]()

    sched = TaskScheduler([spec], Source(), WatchedPool(core, journal, hold=sc["release"] == "hold"), config,
                          batching_strategy=STRATEGIES[sc["strategy"]], on_task_done=on_done)
    step = asyncio.ensure_future(sched.execute_rollout(0, complete_after=sc["complete_after"]))
    cancelled_at = None
    if sc["cancel_at"] is not None:
        await asyncio.sleep(sc["cancel_at"] * H)
        cancelled_at = loop_time()
        step.cancel()
        if sc["cancel_twice"]:
            await asyncio.sleep(0.5 * H)  # lands in the middle of teardowns
            step.cancel()
    outcome, result = await ending(step, sc)
    ended = len(journal.events)
    frozen = msgspec.to_builtins(result) if result is not None else None
    await asyncio.sleep(2000 * H)  # anything of the step still alive would act now
    assert journal.events[ended:] == [], f"the step acted after it {outcome}: {journal.events[ended:]}"
    assert journal.violations == []
    assert journal.live == {}, "an episode was never torn down"
    assert core.held == 0 and core.snapshot() == initial
    if outcome == "cancelled":  # its episodes end there: none starts later, even after one swallowed it
        assert not [e for t, e in journal.events if t > cancelled_at and e.startswith("start")]
    if outcome == "refused":
        assert not any(e.startswith("start") for _, e in journal.events)
    if result is not None:
        assert msgspec.to_builtins(result) == frozen, "the result changed after it was returned"
        assert sc["strategy"] in ("fifo", "longest_first")
        check_complete(result, plan, len(tasks) if sc["complete_after"] is None else sc["complete_after"])
    return outcome


def check_complete(result, plan, n_complete):
    """Every group once, complete (all samples terminal) or, past ``complete_after``, unfinished."""
    complete = [(s.task_id, s.index) for g in result.groups for s in g]
    cut = [(s.task_id, s.index) for u in result.unfinished for s in u.samples]
    assert sorted(complete + cut) == sorted(plan), "a sample is missing or came back twice"
    assert len(result.groups) == min(n_complete, len(result.groups) + len(result.unfinished))
    for g in result.groups:
        for s in g:
            assert s.status in TERMINAL
            fault, _, _, verify_fails = plan[(s.task_id, s.index)]
            if fault not in ("ok", "swallow") or verify_fails:
                assert s.status is Status.ABORTED and s.remove_sample
                assert trainer_metadata(s)["_termination_reason"] in set(AbortReason)
            else:
                assert s.status is Status.COMPLETED and s.reward == {"score": 1.0}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario)
def test_every_sample_once_the_pool_whole_and_nothing_after_the_step(sc):
    event(run_virtual(one_step(sc)))  # the outcomes' spread shows in --hypothesis-show-statistics


# ---- the same invariants, one fault at a time ------------------------------------------------------

def base(**over):
    sc = {"groups": [[("ok", 1, 1, False)] * 2, [("ok", 3, 2, False)] * 2, [("ok", 2, 1, False)]],
          "strategy": "fifo", "bad_callback": None, "complete_after": None, "cancel_at": None, "cancel_twice": False,
          "concurrency": 2, "batch_size": 2, "release": "early"}
    return {**sc, **over}


@pytest.mark.parametrize("sc, outcome", [
    (base(), "done"),
    (base(bad_callback=(0, "raise")), "failed"),  # the other batch's episodes torn down before their tokens go back
    (base(bad_callback=(0, "cancel")), "failed"),  # a callback's own CancelledError fails the step, loudly
    (base(bad_callback=(1, "exit")), "failed"),
    (base(bad_callback=(2, "interrupt")), "failed"),
    (base(bad_callback=(0, "hang"), cancel_at=5), "cancelled"),
    (base(complete_after=1), "done"),
    (base(cancel_at=1.5), "cancelled"),
    (base(cancel_at=1.5, cancel_twice=True), "cancelled"),  # a second cancel does not cut a teardown short
    (base(groups=[[(f, 1, 1, False) for f in RUN_FAULTS]]), "done"),
    (base(groups=[[("swallow", 2, 1, False)] * 3] * 2, concurrency=1, batch_size=2, cancel_at=1), "cancelled"),
    (base(strategy="drop"), "refused"),
    (base(strategy="duplicate"), "refused"),
])
def test_one_fault_at_a_time(sc, outcome):
    assert run_virtual(one_step(sc)) == outcome
