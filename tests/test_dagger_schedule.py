"""DAggerSchedule against hand-computed values of its formulas, the STACX_* publication and its
t_max_step guard, the eval rule for β, and flag parsing."""

import argparse
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.recipe.environment import read_environment
from rayapp.record import Iteration
from rayapp.steps.dagger_schedule import (
    ENV_BETA,
    ENV_EVAL_BETA,
    ENV_ROLLOUT_ID,
    ENV_T_MAX,
    FLAGS,
    DAggerIterations,
    DAggerSchedule,
    add_dagger_args,
)
from rayapp.steps.stacx_env import StacxEnv, env_values
from rayapp.types import StepKind


def publish(state, env=None):
    """What the observer writes for a rollout step with ``state``; the values it wrote."""
    StacxEnv(env).published(StepKind.ROLLOUT, state)
    return env_values(state)


def eval_beta(env):
    """Eval's β as the recipe's build reads it from ``env`` (``rayapp.recipe.environment``)."""
    return read_environment(env).eval_beta


def iterations(schedule, env, observers=()):
    """The schedule's DAggerIterations with the user-set variables of ``env``, read as the build does."""
    read = read_environment(env)
    return DAggerIterations(schedule, read.eval_beta, read.static_t_max, observers=observers)


def pop_beta_for_eval(env):
    """An eval step's β and what the observer does to ``env`` with it."""
    beta = eval_beta(env)
    view = DAggerSchedule().state(0)
    StacxEnv(env).published(StepKind.EVAL, msgspec.structs.replace(view, beta=beta))
    return beta

# (schedule, {iteration: β}), every β worked out by hand from the module docstring's formulas.
BETA_TABLE = [
    # linear 1.0 -> 0.1 over 4: step of 0.9/4 = 0.225, then clamped at the floor
    (DAggerSchedule("linear", beta_start=1.0, beta_end=0.1, decay_iters=4),
     {0: 1.0, 1: 0.775, 2: 0.55, 3: 0.325, 4: 0.1, 5: 0.1, 100: 0.1}),
    # cosine 1.0 -> 0.0 over 4: (1 + cos(pi*t/4)) / 2; cos(pi/4) = 0.70710678...
    (DAggerSchedule("cosine", beta_start=1.0, beta_end=0.0, decay_iters=4),
     {0: 1.0, 1: 0.8535533905932737, 2: 0.5, 3: 0.14644660940672627, 4: 0.0, 9: 0.0}),
    # cosine 1.0 -> 0.2 over 4: 0.2 + 0.8 * the above
    (DAggerSchedule("cosine", beta_start=1.0, beta_end=0.2, decay_iters=4),
     {0: 1.0, 1: 0.8828427124746190, 2: 0.6, 3: 0.3171572875253810, 4: 0.2, 7: 0.2}),
    # exponential 1.0 * 0.5**t, floor 0.1: 1, .5, .25, .125, then .0625 -> .1
    (DAggerSchedule("exponential", beta_start=1.0, beta_end=0.1, gamma=0.5),
     {0: 1.0, 1: 0.5, 2: 0.25, 3: 0.125, 4: 0.1, 20: 0.1}),
    # exponential 0.9 * 0.8**t, floor 0: 0.72, 0.576, 0.4608
    (DAggerSchedule("exponential", beta_start=0.9, beta_end=0.0, gamma=0.8),
     {0: 0.9, 1: 0.72, 2: 0.576, 3: 0.4608}),
    # step 0.8 * 0.5**(t//3), floor 0.05: halves at t = 3, 6, 9, 12; 0.025 at t=15 -> 0.05
    (DAggerSchedule("step", beta_start=0.8, beta_end=0.05, step_size=3, step_gamma=0.5),
     {0: 0.8, 2: 0.8, 3: 0.4, 5: 0.4, 6: 0.2, 9: 0.1, 12: 0.05, 15: 0.05}),
    # step without step_gamma uses gamma: 1.0 * 0.1**(t//2)
    (DAggerSchedule("step", beta_start=1.0, beta_end=0.0, step_size=2, gamma=0.1),
     {0: 1.0, 1: 1.0, 2: 0.1, 3: 0.1, 4: 0.01}),
    # decay_iters 0: the decay is already over at iteration 0
    (DAggerSchedule("linear", beta_start=1.0, beta_end=0.3, decay_iters=0), {0: 0.3, 5: 0.3}),
]


@pytest.mark.parametrize(("schedule", "expected"), BETA_TABLE, ids=lambda x: getattr(x, "beta_schedule", ""))
def test_beta_matches_the_formula(schedule, expected):
    for t, beta in expected.items():
        assert schedule.beta(t) == pytest.approx(beta, abs=1e-12), f"{schedule.beta_schedule} at t={t}"


def test_beta_hits_start_and_end_exactly():
    # Not approx: the floor must be reached bit for bit, or a β=0 student-only phase never starts.
    for kind in ("linear", "cosine"):
        s = DAggerSchedule(kind, beta_start=0.7, beta_end=0.1, decay_iters=3)
        assert s.beta(0) == 0.7 and s.beta(3) == 0.1 and s.beta(50) == 0.1


# (t_max_start, t_max_end, t_max_step, {iteration: t_max}, ramp iterations)
T_MAX_TABLE = [
    (2, 10, 3, {0: 2, 1: 5, 2: 8, 3: 10, 4: 10, 99: 10}, 3),  # up by 3, the last step clamped
    (10, 4, 4, {0: 10, 1: 6, 2: 4, 3: 4}, 2),  # a ramp can shrink the tail too
    (0, 6, 2, {0: 0, 1: 2, 2: 4, 3: 6, 4: 6}, 3),
    (5, 20, 0, {0: 5, 1: 5, 50: 5}, 0),  # step 0: the ramp is off, t_max stays at the start
]


@pytest.mark.parametrize(("start", "end", "step", "expected", "ramp_iters"), T_MAX_TABLE)
def test_t_max_ramp(start, end, step, expected, ramp_iters):
    s = DAggerSchedule(t_max_start=start, t_max_end=end, t_max_step=step)
    if step:  # t_max first reaches its end after ramp_iters iterations
        assert s.t_max(ramp_iters) == end and s.t_max(ramp_iters - 1) != end
    for t, t_max in expected.items():
        value = s.t_max(t)
        assert value == t_max and isinstance(value, int), f"t={t}"


schedules = st.builds(
    lambda kind, a, b, T, g, size, sg: DAggerSchedule(kind, beta_start=max(a, b), beta_end=min(a, b),
                                                      decay_iters=T, gamma=g, step_size=size, step_gamma=sg),
    st.sampled_from(["linear", "cosine", "exponential", "step"]),
    st.floats(0, 1), st.floats(0, 1), st.integers(0, 10_000), st.floats(0, 1), st.integers(1, 50),
    st.none() | st.floats(0, 1),
)


@given(schedules, st.integers(0, 20_000))
def test_beta_never_increases_and_stays_in_range(schedule, t):
    a, b = schedule.beta(t), schedule.beta(t + 1)
    assert b <= a
    assert schedule.beta_end <= b <= a <= schedule.beta_start


@given(st.integers(0, 100), st.integers(0, 100), st.integers(1, 30), st.integers(0, 200))
def test_t_max_moves_monotonically_to_its_end(start, end, step, t):
    s = DAggerSchedule(t_max_start=start, t_max_end=end, t_max_step=step)
    now, nxt = s.t_max(t), s.t_max(t + 1)
    assert min(start, end) <= now <= max(start, end)
    assert (nxt >= now) if end >= start else (nxt <= now)
    assert s.t_max(math.ceil(abs(end - start) / step)) == end  # the ramp ends after |end - start| / step steps


def test_state_and_env_with_the_ramp_on():
    s = DAggerSchedule("linear", beta_start=1.0, beta_end=0.0, decay_iters=4, t_max_start=2, t_max_end=10,
                       t_max_step=3)
    state = s.state(1)
    assert state == Iteration(rollout_id=1, beta=0.75, t_max=5, t_max_step=3)
    assert env_values(state) == {ENV_ROLLOUT_ID: "1", ENV_BETA: "0.75", ENV_T_MAX: "5"}


def test_env_round_trips_beta_exactly():
    s = DAggerSchedule("cosine", beta_start=1.0, beta_end=0.0, decay_iters=7)
    for t in range(8):
        assert float(env_values(s.state(t))[ENV_BETA]) == s.beta(t)


def test_t_max_step_guard_keeps_a_static_tail_length():
    env = {ENV_T_MAX: "12", "OTHER": "x"}
    written = publish(DAggerSchedule(t_max_step=0).state(3), env)
    assert ENV_T_MAX not in written
    assert env == {ENV_T_MAX: "12", "OTHER": "x", ENV_ROLLOUT_ID: "3", ENV_BETA: repr(DAggerSchedule().beta(3))}
    publish(DAggerSchedule(t_max_start=1, t_max_end=9, t_max_step=2).state(3), env)
    assert env[ENV_T_MAX] == "7"


@pytest.mark.parametrize(("static", "schedule", "rollout_id", "seen"), [
    ("12", DAggerSchedule(t_max_step=0), 3, 12),                                # the static length, not 0
    ("12", DAggerSchedule(t_max_start=4, t_max_step=0), 3, 12),                 # the static length wins
    (None, DAggerSchedule(t_max_start=4, t_max_step=0), 3, 4),                  # none set: the start
    (None, DAggerSchedule(t_max_step=0), 3, None),                              # no tail length at all
    ("0", DAggerSchedule(t_max_step=0), 3, None),
    ("12", DAggerSchedule(t_max_start=1, t_max_end=9, t_max_step=2), 3, 7),     # the ramp: its value
    (None, DAggerSchedule(t_max_start=0, t_max_end=9, t_max_step=2), 0, None),  # the ramp at 0
])
def test_agents_see_the_guarded_t_max_never_0(static, schedule, rollout_id, seen):
    env = {} if static is None else {ENV_T_MAX: static}
    it = iterations(schedule, env, observers=[StacxEnv(env)])
    for state in (it.rollout_state(rollout_id), it.eval_state(rollout_id)):
        assert (state.t_max or None) == seen
        assert state.rollout_id == rollout_id and state.t_max_step == schedule.t_max_step
    assert env.get(ENV_T_MAX) == (static if not schedule.t_max_step else str(schedule.t_max(rollout_id)))


@settings(max_examples=60)
@given(start=st.integers(0, 50), end=st.integers(0, 50), step=st.integers(0, 5), t=st.integers(0, 40),
       static=st.one_of(st.none(), st.integers(0, 99)))
def test_agents_get_the_ramp_else_the_static_else_the_start_t_max_and_never_0(start, end, step, t, static):
    env = {} if static is None else {ENV_T_MAX: str(static)}
    schedule = DAggerSchedule(t_max_start=start, t_max_end=end, t_max_step=step)
    state = iterations(schedule, env).rollout_state(t)
    want = schedule.t_max(t) if step else (static if static is not None else start)
    assert state.t_max == want


@pytest.mark.parametrize("bad", ["-3", "five", "1.5", "9" * 5000])
def test_a_bad_static_tail_length_is_one_error_and_publishes_nothing(bad):
    env = {ENV_T_MAX: bad}
    with pytest.raises(ValueError, match=f"{ENV_T_MAX}='.*': a statically set tail length must be an integer >= 0"):
        iterations(DAggerSchedule(t_max_step=0), env, observers=[StacxEnv(env)]).rollout_state(2)
    assert env == {ENV_T_MAX: bad}


def test_publish_defaults_to_os_environ(monkeypatch):
    for name in (ENV_ROLLOUT_ID, ENV_BETA, ENV_T_MAX):
        monkeypatch.delenv(name, raising=False)
    import os

    publish(Iteration(rollout_id=4, beta=0.25, t_max=3, t_max_step=1))
    assert (os.environ[ENV_ROLLOUT_ID], os.environ[ENV_BETA], os.environ[ENV_T_MAX]) == ("4", "0.25", "3")


def test_eval_pops_beta_to_run_student_only():
    env = {ENV_BETA: "0.6", ENV_ROLLOUT_ID: "2"}
    assert pop_beta_for_eval(env) == 0.0
    assert env == {ENV_ROLLOUT_ID: "2"}  # popped, and nothing restored
    assert pop_beta_for_eval(env) == 0.0  # no β published at all is fine too


@pytest.mark.parametrize("eval_beta", ["", "  "])
def test_an_empty_eval_beta_counts_as_unset(eval_beta):
    env = {ENV_BETA: "0.6", ENV_EVAL_BETA: eval_beta}
    assert pop_beta_for_eval(env) == 0.0 and ENV_BETA not in env


def test_eval_beta_reinjects():
    env = {ENV_BETA: "0.6", ENV_EVAL_BETA: "0.3"}
    assert pop_beta_for_eval(env) == 0.3
    assert env[ENV_BETA] == "0.3" and env[ENV_EVAL_BETA] == "0.3"


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "nan", "half"])
def test_bad_eval_beta_is_one_error_and_changes_nothing(bad):
    env = {ENV_BETA: "0.6", ENV_EVAL_BETA: bad}
    with pytest.raises(ValueError, match=ENV_EVAL_BETA):
        pop_beta_for_eval(env)
    assert env == {ENV_BETA: "0.6", ENV_EVAL_BETA: bad}


def test_from_flags_argv_ignores_other_components_flags():
    s = DAggerSchedule.from_flags(["--lr", "1e-5", "--dagger-beta-schedule", "step", "--dagger-beta-start=0.8",
                                   "--dagger-beta-end", "0.05", "--dagger-step-size", "3", "--dagger-step-gamma",
                                   "0.5", "--dagger-t-max-start", "2", "--dagger-t-max-end", "10",
                                   "--dagger-t-max-step", "3"])
    assert s == DAggerSchedule("step", beta_start=0.8, beta_end=0.05, step_size=3, step_gamma=0.5, t_max_start=2,
                               t_max_end=10, t_max_step=3)
    assert DAggerSchedule.from_flags([]) == DAggerSchedule() == DAggerSchedule.from_flags(None)


def test_from_flags_mapping_in_any_spelling():
    s = DAggerSchedule.from_flags({"--dagger-beta-schedule": "exponential", "dagger_gamma": 0.9,
                                   "decay_iters": 7, "beta-end": 0.1, "step_gamma": None})
    assert s == DAggerSchedule("exponential", gamma=0.9, decay_iters=7, beta_end=0.1)


def test_add_dagger_args_on_a_trainers_parser():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-5)
    add_dagger_args(parser)
    args = parser.parse_args(["--dagger-beta-schedule", "cosine", "--dagger-decay-iters", "20"])
    assert DAggerSchedule.from_flags(args) == DAggerSchedule("cosine", decay_iters=20)
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for flag in FLAGS.values():  # what a generated knob reference reads
        assert by_flag[flag].help and "default" in by_flag[flag].help, flag


@pytest.mark.parametrize(("flags", "named"), [
    (["--dagger-beta-start", "1.5"], "--dagger-beta-start"),
    (["--dagger-beta-end", "-0.1"], "--dagger-beta-end"),
    (["--dagger-beta-start", "0.2", "--dagger-beta-end", "0.5"], "--dagger-beta-end"),
    (["--dagger-beta-start", "nan"], "--dagger-beta-start"),
    (["--dagger-decay-iters", "-1"], "--dagger-decay-iters"),
    (["--dagger-decay-iters", "2.5"], "--dagger-decay-iters"),
    (["--dagger-t-max-step", "-2"], "--dagger-t-max-step"),
    (["--dagger-t-max-end=-3"], "--dagger-t-max-end"),
    (["--dagger-step-size", "0"], "--dagger-step-size"),
    (["--dagger-gamma", "1.2"], "--dagger-gamma"),
    (["--dagger-step-gamma", "2"], "--dagger-step-gamma"),
    (["--dagger-beta-schedule", "sigmoid"], "--dagger-beta-schedule"),
    (["--dagger-beta-start", "high"], "--dagger-beta-start"),
    (["--dagger-bta-start", "0.5"], "--dagger-bta-start"),  # a typo is an error, not a silent default
])
def test_bad_flags_are_one_error_naming_the_flag(flags, named):
    with pytest.raises(ValueError, match=named):
        DAggerSchedule.from_flags(flags)


def test_bad_values_through_the_other_paths():
    with pytest.raises(ValueError, match="--dagger-beta-schedule"):
        DAggerSchedule("sigmoid")
    with pytest.raises(ValueError, match="--dagger-beta-start"):
        DAggerSchedule(beta_start="0.5")
    with pytest.raises(ValueError, match="--dagger-decay-iters"):
        DAggerSchedule.from_flags({"decay_iters": -4})
    with pytest.raises(ValueError, match=r"^lr: unknown DAgger flag"):
        DAggerSchedule.from_flags({"lr": 0.1})
    with pytest.raises(ValueError, match="iteration"):
        DAggerSchedule().beta(-1)


def test_roll_in_metrics_count_who_acted_and_the_labels():
    from rayapp.record import Actor, DaggerLabel, EpisodeRecord, TurnRecord
    from rayapp.steps.dagger_schedule import roll_in_metrics
    from rayapp.types import Sample

    def s(actors, labels=0):  # a sample with the record of a roll-in
        record = EpisodeRecord(turn_records=[TurnRecord(i, "e", actor=Actor(a)) for i, a in enumerate(actors, 1)],
                               dagger_labels=[DaggerLabel(1, 3, [4], "x")] * labels)
        return Sample("t", 0, "p", None, episode=record)

    groups = [[s(["teacher", "student"], 1), s(["student", "student"], 2)], [s(["teacher"])]]
    assert roll_in_metrics(groups) == {"dagger/turns/teacher": 2.0, "dagger/turns/student": 3.0,
                                       "dagger/labels": 3.0, "dagger/teacher_turn_share": 0.4}
    assert roll_in_metrics([[Sample("t", 0, "p", None)]]) == {}  # no roll-ins: no dagger metrics
