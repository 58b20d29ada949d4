"""GymAgent: gym-style text environments (observation, reward, done per step). The token layout is
checked exactly against a scripted engine speaking through the real tiny tokenizer; then one
episode of SkyRL-gym's multi-turn GSM8K environment, installed from PyPI (the ``gym`` extra)."""

import asyncio

import pytest
from agent_helpers import InProcessEngine, ScriptedEngine, ctx, recording
from conftest import run

from rayapp.envs.agents.gym import GymAgent, skyrl_gym_env
from rayapp.types import Sample

QUESTION = "Guess my number."


class Guess:
    """A plain env: the model guesses a number; each wrong guess gets a hint and no reward."""

    def __init__(self, secret="4", done_on_wrong=False):
        self.secret, self.done_on_wrong, self.actions, self.closed = secret, done_on_wrong, [], False

    def step(self, action):
        self.actions.append(action)
        if self.secret in action:
            return None, 1.0, True, {}
        return f"Not {action!r}. Try again.", 0.25, self.done_on_wrong, {"wrong": True}

    def close(self):
        self.closed = True


def sample(label="4"):
    return Sample("g", 0, QUESTION, label)


def env_turn(tok, text):
    """The tiny template's rendering of one user message and the next generation prompt, written
    out by hand (not through the agent's code): what an observation's tokens must be."""
    return tok.encode(f"<|user|>{text}{tok.eos_token}<|assistant|>", add_special_tokens=False)


def episode(tok, model_dir, script, env, c=None, **kw):
    engine = recording(ScriptedEngine(tok, model_dir, script))
    agent = GymAgent(engine, lambda s: env, **kw)
    c = c or ctx()
    result = run(agent.run(sample(), c))
    return engine, agent, result, run(agent.evaluate(sample(), result, c))


def test_the_token_layout_is_exact_model_tokens_mask_1_observations_mask_0(tok, model_dir):
    env = Guess()
    engine, _, result, reward = episode(tok, model_dir, ["7", "5", "It is 4."], env)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
    o1, o2 = (env_turn(tok, f"Not {a!r}. Try again.") for a in ("7", "5"))
    m1, m2, m3 = engine.outputs
    assert all(m[-1] == tok.eos_token_id for m in engine.outputs)  # so no closing eos is added
    assert result.tokens == [*prompt, *m1, *o1, *m2, *o2, *m3]
    assert result.response_length == len(result.tokens) - len(prompt)
    assert result.loss_mask == [1] * len(m1) + [0] * len(o1) + [1] * len(m2) + [0] * len(o2) + [1] * len(m3)
    lp = engine.logprobs
    assert result.rollout_log_probs == [*lp[0], *[0.0] * len(o1), *lp[1], *[0.0] * len(o2), *lp[2]]
    # the env saw each turn's text, and every request was the whole context so far
    assert env.actions == ["7", "5", "It is 4."] and env.closed
    assert [r.input_ids for r in engine.sent] == [prompt, [*prompt, *m1, *o1], [*prompt, *m1, *o1, *m2, *o2]]
    assert (result.termination_reason, result.truncated, result.turns) == ("stop", False, 3)
    assert result.metadata == {"env_rewards": [0.25, 0.25, 1.0], "env_done": True}
    assert reward == {"score": 1.5}  # the return: the rewards summed


def test_a_turn_cut_at_a_stop_string_is_closed_before_the_observation(tok, model_dir):
    c = ctx(stop=["!"])
    engine, _, result, _ = episode(tok, model_dir, ["7! and more", "4"], Guess(), c)
    m1 = engine.outputs[0]
    assert m1[-1] != tok.eos_token_id
    start = len(result.tokens) - result.response_length
    # the template closes the model's turn with eos: the env's tokens start with it, at mask 0
    obs = [tok.eos_token_id, *env_turn(tok, "Not '7'. Try again.")]
    assert result.tokens[start:start + len(m1) + len(obs)] == [*m1, *obs]
    assert result.loss_mask[:len(m1) + len(obs)] == [1] * len(m1) + [0] * len(obs)


def test_last_reward_max_turns_and_an_env_that_ends_the_episode(tok, model_dir):
    env = Guess()
    engine, _, result, reward = episode(tok, model_dir, ["1", "2", "3"], env, ctx(max_turns=2), reward="last")
    assert (result.termination_reason, result.truncated, result.turns) == ("max_turns", True, 2)
    assert env.actions == ["1", "2"] and reward == {"score": 0.25}  # the last turn is scored too...
    assert result.tokens[-len(engine.outputs[-1]):] == engine.outputs[-1]  # ...and no observation follows it

    env = Guess(done_on_wrong=True)  # done with an observation: nothing is rendered after the last turn
    engine, _, result, reward = episode(tok, model_dir, ["1", "2"], env)
    assert (result.termination_reason, result.turns, reward) == ("stop", 1, {"score": 0.25})
    assert result.loss_mask == [1] * len(engine.outputs[0])


def test_the_context_limit_ends_the_episode_within_it(tok, model_dir):
    prompt_len = len(tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    for limit in range(prompt_len, prompt_len + 40, 3):
        env = Guess()
        engine, _, result, reward = episode(tok, model_dir, ["1", "2", "3", "4"], env, ctx(max_turns=6,
                                                                                          max_context_len=limit))
        assert len(result.tokens) <= limit and result.termination_reason == "max_context_len"
        assert result.truncated and env.closed
        assert reward == {"score": 0.25 * len(env.actions)}  # each action that was taken is scored
        model = [t for t, m in zip(result.tokens[prompt_len:], result.loss_mask, strict=True) if m]
        assert model == [i for out in engine.outputs for i in out]


def test_reset_async_methods_and_gymnasium_tuples(tok, model_dir):
    class AsyncEnv:
        def __init__(self):
            self.closed = False

        async def reset(self, s):
            return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{s.prompt} (1-9)"}]

        async def step(self, action):
            await asyncio.sleep(0)
            return "Lower.", 0.0, False, True, {}  # terminated False, truncated True: done

        async def close(self):
            self.closed = True

    env = AsyncEnv()
    engine, _, result, reward = episode(tok, model_dir, ["9"], env)
    assert tok.decode(engine.sent[0].input_ids).count("(1-9)") == 1 and "Be brief." in tok.decode(result.tokens)
    assert (result.termination_reason, reward, env.closed) == ("stop", {"score": 0.0}, True)


def test_the_skyrl_gym_shape_init_and_a_step_dict(tok, model_dir):
    class SkyRLShaped:  # BaseTextEnv's signatures, without the package
        def init(self, prompt):
            return [*prompt, {"role": "user", "content": "Answer with a number."}], {}

        def step(self, action):
            return {"observations": [{"role": "tool", "content": "no"}], "reward": 0.5, "done": False,
                    "metadata": {}}

    engine, _, result, reward = episode(tok, model_dir, ["1", "2"], SkyRLShaped(), ctx(max_turns=2))
    first = tok.decode(engine.sent[0].input_ids)
    assert first.index(QUESTION) < first.index("Answer with a number.")
    obs = tok.encode(f"<|tool|>no{tok.eos_token}<|assistant|>", add_special_tokens=False)
    m1, m2 = engine.outputs
    assert result.tokens[-(len(m1) + len(obs) + len(m2)):] == [*m1, *obs, *m2]
    assert (result.termination_reason, reward) == ("max_turns", {"score": 1.0})


def test_bad_environments_fail_with_one_clear_error(tok, model_dir):
    class NoStep:
        pass

    class BadReward(Guess):
        def step(self, action):
            return "x", "high", False, {}

    class BadShape(Guess):
        def step(self, action):
            return {"obs": "x"}

    with pytest.raises(TypeError, match="gym env NoStep: it has no step"):
        episode(tok, model_dir, ["1"], NoStep())
    env = BadReward()
    with pytest.raises(ValueError, match="gym env BadReward: step\\(\\) returned the reward 'high', not a number"):
        episode(tok, model_dir, ["1"], env)
    assert env.closed  # closed however the episode ends
    with pytest.raises(ValueError, match="gym env BadShape: step\\(\\) returned \\{'obs': 'x'\\}"):
        episode(tok, model_dir, ["1"], BadShape())
    with pytest.raises(ValueError, match="reward must be 'sum' or 'last'"):
        GymAgent(None, Guess, reward="mean")


def test_a_skyrl_gym_multi_turn_env_from_pypi_runs_to_its_reward(tok, model_dir):
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="the 'gym' extra (skyrl-gym) is not installed")
    script = ["I think it is 41.\n#### 41", "#### 42"]
    engine = recording(ScriptedEngine(tok, model_dir, list(script)))
    agent = GymAgent(engine, skyrl_gym_env("gsm8k_multi_turn"))
    s = Sample("gsm8k", 0, "Natalia sold 21 clips twice. How many clips?", "42")
    c = ctx(max_turns=5)
    result = run(agent.run(s, c))
    reward = run(agent.evaluate(s, result, c))

    # the same env, driven by hand with the engine's texts: the agent's reward is the env's
    twin = skyrl_gym.make("gsm8k_multi_turn", env_config=None,
                          extras={"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {}})
    twin.init([{"role": "user", "content": s.prompt}])
    steps = [twin.step(text) for text in engine.texts]
    assert engine.texts == script and steps[-1]["done"] and not steps[0]["done"]
    assert result.metadata == {"env_rewards": [st["reward"] for st in steps], "env_done": True}
    assert 0 < steps[0]["reward"] < 1 and steps[1]["reward"] == 1.0  # a format reward, then the answer
    assert reward == {"score": pytest.approx(sum(st["reward"] for st in steps))}
    assert (result.termination_reason, result.turns) == ("stop", 2)
    # the env's observation is in the context, as the chat template renders it, at mask 0
    [observation] = steps[0]["observations"]
    obs = env_turn(tok, observation["content"])
    m1 = engine.outputs[0]
    start = len(result.tokens) - result.response_length
    assert result.tokens[start + len(m1):start + len(m1) + len(obs)] == obs
    assert result.loss_mask == [1] * len(m1) + [0] * len(obs) + [1] * len(engine.outputs[1])

    with pytest.raises(ValueError, match=r"no SkyRL-gym env 'gsm8k_multiturn'; registered: .*'gsm8k_multi_turn'"):
        skyrl_gym_env("gsm8k_multiturn")


def test_a_skyrl_gym_episode_on_the_real_hf_engine(tok, model_dir):
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="the 'gym' extra (skyrl-gym) is not installed")
    from rayapp.inference.hf import HFBackend

    backend = HFBackend(str(model_dir), seed=0)

    engine = recording(InProcessEngine(backend))
    agent = GymAgent(engine, skyrl_gym_env("gsm8k_multi_turn"))
    s = Sample("gsm8k", 0, "What is 40 + 2?", "42")
    c = ctx(max_turns=3, max_context_len=400)
    try:
        result = run(asyncio.wait_for(agent.run(s, c), 120))
    finally:
        backend.shutdown()
    twin = skyrl_gym.make("gsm8k_multi_turn", env_config=None,
                          extras={"reward_spec": {"method": "rule", "ground_truth": "42"}, "extra_info": {}})
    rewards = [twin.step(text)["reward"] for text in engine.texts]
    assert result.metadata["env_rewards"] == rewards and len(rewards) == result.turns == len(engine.outputs)
    assert run(agent.evaluate(s, result, c)) == {"score": sum(rewards)}
    assert len(result.tokens) <= 400 and result.termination_reason in {"stop", "max_turns", "max_context_len"}
    response = result.tokens[-result.response_length:]
    model = [t for t, m in zip(response, result.loss_mask, strict=True) if m]
    assert model == [i for out in engine.outputs for i in out]  # the engine's own ids, never re-tokenized
    assert [lp for lp, m in zip(result.rollout_log_probs, result.loss_mask, strict=True) if m] == \
        [lp for out in engine.logprobs for lp in out]
    assert "#### ANSWER" in tok.decode([t for t, m in zip(response, result.loss_mask, strict=True) if not m])
