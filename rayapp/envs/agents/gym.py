"""An agent for gym-style text environments: each model turn is an action, and the environment answers
it with an observation, a reward and whether the episode is done.

It exists so an environment that scores each turn needs no agent code: ``env_factory(sample)`` makes
one environment per episode, a plain ``step``/``reset``/``close`` object or a SkyRL-gym text
environment (``skyrl_gym_env``), sync or async. Invariant: the token data is ``ToolAgent``'s (the
engine's ids with its log-probs and mask 1, observations rendered by the chat template with mask 0),
and the environment steps on every model turn, the last too, so every action is scored. Not
resumable: the environment's state is not in the tokens. Shapes, stopping and scores:
docs/plugins.md, "Gym-style environments".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from rayapp.core.agent import phase_caller
from rayapp.envs.agents.chat import ChatAgent
from rayapp.envs.agents.observation import TokenData, length_reason, observation_tokens, turn_budget
from rayapp.envs.protocol import Engine
from rayapp.episode import EpisodeContext
from rayapp.inference.client import FinishReason
from rayapp.record import TerminationReason
from rayapp.types import AgentResult, Sample

# env_factory(sample) -> a gym environment (or an awaitable of one)
EnvFactory = Callable[[Sample], Any]
Messages = list[dict[str, Any]]


class GymStep(NamedTuple):
    """One environment step, whatever shape the environment returned it in."""

    observation: Messages
    reward: float
    done: bool


class GymAgent(ChatAgent):
    resumable = False  # the environment's state is not in the token data (module docstring)

    def __init__(self, engine: Engine, env_factory: EnvFactory, *, reward: Literal["sum", "last"] = "sum",
                 system_prompt: str | None = None):
        if reward not in ("sum", "last"):
            raise ValueError(f"GymAgent: reward must be 'sum' or 'last', not {reward!r}")
        if not callable(env_factory):
            raise TypeError(f"GymAgent: env_factory must be a callable taking the sample, not {env_factory!r}")
        super().__init__(engine, None, system_prompt=system_prompt)  # the environment scores the episode
        self.env_factory, self.reward = env_factory, reward

    async def run(self, sample: Sample, ctx: EpisodeContext) -> AgentResult:
        tok = await self.tokenizer()
        env = _Env(await phase_caller(self.env_factory)(sample))
        try:
            messages = await env.reset(sample, self.messages(sample))
            prompt = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
            return await self._episode(tok, env, prompt, sample, ctx)
        finally:
            await env.close()

    async def _episode(self, tok: Any, env: _Env, prompt: list[int], sample: Sample,
                       ctx: EpisodeContext) -> AgentResult:
        data, rewards, done = TokenData(list(prompt)), [], False
        limit, max_turns = ctx.stopping.max_context_len, ctx.stopping.max_turns or 1
        reason, final_text = TerminationReason.MAX_TURNS, ""
        for turn in range(1, max_turns + 1):
            budget = turn_budget(ctx.sampling, limit, len(data.ids))
            if budget is None:
                reason = TerminationReason.MAX_CONTEXT_LEN
                break
            turn_sampling, room = budget
            out, weight = await self.turn(tok, list(data.ids), ([], []), turn_sampling, turn, sample, ctx)
            data.add(out.output_ids, weight, out.logprobs)
            final_text = out.text
            step = await env.step(out.text)
            rewards.append(step.reward)
            if step.done:
                done, reason = True, TerminationReason.STOP
                break
            if out.finish_reason is FinishReason.LENGTH:
                reason = length_reason(turn_sampling, room, out)
                break
            if turn == max_turns:
                break
            obs, cut = observation_tokens(tok, step.observation, out.output_ids,
                                          None if limit is None else limit - len(data.ids))
            data.add(obs, 0)
            if cut:
                reason = TerminationReason.MAX_CONTEXT_LEN
                break
        return AgentResult(tokens=data.ids, response_length=len(data.ids) - len(prompt), response=final_text,
                           rollout_log_probs=data.logprobs, loss_mask=data.mask, turns=ctx.record.turns or 0,
                           termination_reason=reason, truncated=reason is not TerminationReason.STOP,
                           metadata={"env_rewards": rewards, "env_done": done})

    async def evaluate(self, sample: Sample, result: AgentResult, ctx: EpisodeContext) -> dict[str, float]:
        rewards = result.metadata.get("env_rewards") or [0.0]  # no step: the prompt alone filled the context
        return {"score": float(sum(rewards) if self.reward == "sum" else rewards[-1])}


class _Env:
    """Either environment shape behind one interface: ``reset``, ``step`` (a ``GymStep``), ``close``."""

    def __init__(self, env: Any):
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"gym env {type(env).__name__}: it has no step(action) method")
        self.env, self.name = env, type(env).__name__
        # SkyRL-gym's envs start with init(prompt_messages); a plain env with reset(sample), or neither
        self.skyrl = callable(getattr(env, "init", None)) and not callable(getattr(env, "reset", None))

    async def _call(self, method: str, *args: Any) -> Any:
        return await phase_caller(getattr(self.env, method))(*args)

    async def reset(self, sample: Sample, messages: Messages) -> Messages:
        if self.skyrl:
            first = await self._call("init", messages)
            if not (isinstance(first, tuple) and len(first) == 2):
                raise ValueError(f"gym env {self.name}: init() returned {first!r}, not (messages, info)")
            return self._messages(first[0], "init")
        if not callable(getattr(self.env, "reset", None)):
            return messages
        first = await self._call("reset", sample)
        return messages if first is None else self._messages(first, "reset")

    async def step(self, action: str) -> GymStep:
        out = await self._call("step", action)
        if isinstance(out, Mapping) and "observations" in out:  # SkyRL-gym's BaseTextEnvStepOutput
            observation, reward, done = out["observations"], out.get("reward"), out.get("done")
        elif isinstance(out, tuple) and len(out) in (4, 5):
            observation, reward, *flags, _info = out
            done = any(flags)  # gymnasium's terminated or truncated
        else:
            raise ValueError(f"gym env {self.name}: step() returned {out!r}, not (observation, reward, done, info) "
                             "or a SkyRL-gym step output")
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise ValueError(f"gym env {self.name}: step() returned the reward {reward!r}, not a number")
        return GymStep(self._messages(observation, "step"), float(reward), bool(done))

    def _messages(self, observation: Any, method: str) -> Messages:
        if observation is None:
            return []
        if isinstance(observation, str):
            return [{"role": "user", "content": observation}]
        if isinstance(observation, Mapping):
            observation = [observation]
        if isinstance(observation, Sequence) and all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                     for m in observation):
            return [dict(m) for m in observation]
        raise ValueError(f"gym env {self.name}: {method}() gave the observation {observation!r}, not a string "
                         "or chat messages ({'role': ..., 'content': ...})")

    async def close(self) -> None:
        if callable(getattr(self.env, "close", None)):
            await self._call("close")


def skyrl_gym_env(env_id: str, env_config: Any = None,
                  extras: Callable[[Sample], dict[str, Any]] | None = None) -> EnvFactory:
    """A factory of SkyRL-gym environments ``env_id`` (``skyrl_gym.make``), one per sample, for
    ``GymAgent``. ``extras(sample)`` gives the environment's ``extras`` (SkyRL-gym's per-row data);
    by default the sample's label is the reference answer: ``{"reward_spec": {"method": "rule",
    "ground_truth": sample.label}, "extra_info": {}}``."""
    try:
        import skyrl_gym
    except ImportError as e:
        raise ImportError(f"skyrl_gym_env({env_id!r}) needs skyrl-gym: pip install 'rayapp[gym]'") from e
    if env_id not in skyrl_gym.registry:
        raise ValueError(f"skyrl_gym_env: no SkyRL-gym env {env_id!r}; registered: {sorted(skyrl_gym.registry)}")

    def make(sample: Sample) -> Any:
        row = extras(sample) if extras is not None else {
            "reward_spec": {"method": "rule", "ground_truth": sample.label}, "extra_info": {}}
        return skyrl_gym.make(env_id, env_config=env_config, extras=row)

    return make
