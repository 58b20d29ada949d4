"""The GRPO trainer's maths, and its agreement with the hf backend: the log-probs it recomputes for
the sampled tokens are the engine's, and the weights it saves are the ones the engine then serves."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.inference.client import GenerateRequest
from rayapp.trainers.grpo import GRPOTrainer, clipped_loss, group_advantages, make_batch, token_logprobs
from rayapp.types import Sample, SamplingParams

rewards = st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=1, max_size=6), min_size=1, max_size=4)


@settings(max_examples=40, deadline=None)
@given(rewards)
def test_advantages_are_normalised_within_each_group_and_independent_of_the_others(groups):
    adv = group_advantages(groups)
    assert [len(a) for a in adv] == [len(g) for g in groups]
    for g, a in zip(groups, adv, strict=True):
        if len(set(g)) == 1:
            assert a == [0.0] * len(g)  # no spread, no signal
            continue
        t = torch.tensor(a, dtype=torch.float64)
        assert abs(float(t.mean())) < 1e-9 and abs(float(t.std(unbiased=False)) - 1) < 1e-4
        # a better reward never gets a smaller advantage
        ranked = sorted(zip(g, a, strict=True))
        assert all(x <= y for (_, x), (_, y) in itertools.pairwise(ranked))
    shifted = group_advantages([[r + 3.0 for r in groups[0]], *groups[1:]])
    assert shifted[1:] == adv[1:] and torch.allclose(torch.tensor(shifted[0]), torch.tensor(adv[0]), atol=1e-6)


def _loss_grad(new, old, adv, mask, eps=0.2):
    new = new.clone().requires_grad_(True)
    loss, stats = clipped_loss(new, old, adv, mask, eps)
    loss.backward()
    return loss, new.grad, stats


def test_on_policy_the_loss_is_minus_the_mean_advantage_and_its_gradient_pushes_each_token_by_its_advantage():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]])
    adv, mask = torch.tensor([1.5, -0.5]), torch.tensor([[1, 1, 0], [0, 1, 1]])
    loss, grad, stats = _loss_grad(old, old, adv, mask)
    assert loss.item() == pytest.approx(-(1.5 * 2 - 0.5 * 2) / 4)
    assert torch.allclose(grad, -adv.unsqueeze(-1) * mask / 4)
    assert stats["clip_frac"] == 0.0


def test_the_clip_stops_the_gradient_only_where_the_ratio_left_the_trust_region_in_the_advantage_s_direction():
    old = torch.zeros(4, 1) - 1.0
    shift = torch.tensor([[0.5], [0.5], [-0.5], [-0.5]])  # ratios e^0.5 ~ 1.65 and e^-0.5 ~ 0.61
    adv, mask = torch.tensor([1.0, -1.0, 1.0, -1.0]), torch.ones(4, 1)
    _, grad, stats = _loss_grad(old + shift, old, adv, mask)
    # ratio above 1 + eps with A > 0, and below 1 - eps with A < 0: clipped, no gradient
    assert grad[0, 0] == 0 and grad[3, 0] == 0
    # the other two still pull (the min picks the unclipped, pessimistic term)
    assert grad[1, 0] > 0 and grad[2, 0] < 0
    assert stats["clip_frac"] == 1.0  # every ratio is outside [0.8, 1.2]


def test_masked_tokens_neither_count_nor_get_a_gradient():
    old = torch.tensor([[-1.0, -2.0, -3.0]])
    adv, mask = torch.tensor([2.0]), torch.tensor([[1, 0, 1]])
    a = old.clone()
    b = old.clone()
    b[0, 1] += 5.0  # a wildly different log-prob on the masked token
    la, ga, _ = _loss_grad(a, old, adv, mask)
    lb, gb, _ = _loss_grad(b, old, adv, mask)
    assert la.item() == lb.item() and ga[0, 1] == 0 and gb[0, 1] == 0


def test_make_batch_puts_log_probs_and_mask_where_the_response_tokens_are_predicted():
    s = Sample("t", 0, "p", tokens=[5, 6, 7, 8, 9], response_length=3, rollout_log_probs=[-0.1, -0.2, -0.3],
               loss_mask=[1, 0, 1])
    b = make_batch([s, Sample("u", 0, "p", tokens=[5, 6, 7], response_length=1, rollout_log_probs=[-0.4],
                              loss_mask=[1])], [1.0, -1.0])
    # column j scores token j + 1: the response tokens 7, 8, 9 sit at 2, 3, 4
    assert b.old_logp[0].tolist() == pytest.approx([0.0, -0.1, -0.2, -0.3])
    assert b.mask[0].tolist() == [0, 1, 0, 1] and b.mask[1].tolist() == [0, 1, 0, 0]
    assert b.attention[1].tolist() == [1, 1, 1, 0, 0] and b.advantages.tolist() == [1.0, -1.0]
    bad = Sample("v", 2, "p", tokens=[5, 6, 7], response_length=2, rollout_log_probs=[-0.1], loss_mask=[1, 1])
    with pytest.raises(ValueError, match="v#2"):
        make_batch([bad], [0.0])


@pytest.fixture(scope="module")
def engine(model_dir):
    from rayapp.inference.hf import HFBackend

    backend = HFBackend(str(model_dir), max_concurrency=4, seed=7)
    yield backend
    backend.shutdown()


def _rollouts(engine, prompts: list[str], n: int, temperature: float) -> list[Sample]:
    tok = engine.tokenizer

    async def one(i: int, prompt: str) -> Sample:
        ids = list(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        out = await engine.generate(GenerateRequest(ids, SamplingParams(temperature=temperature, max_new_tokens=12),
                                                    stop_token_ids=[tok.eos_token_id]))
        return Sample(f"t{i}", i, prompt, tokens=ids + list(out.output_ids), response_length=len(out.output_ids),
                      rollout_log_probs=list(out.logprobs), loss_mask=[1] * len(out.output_ids),
                      metadata={"weight_version": out.weight_version})

    async def main():
        return await asyncio.gather(*(one(i, p) for i in range(n) for p in prompts))

    return asyncio.run(main())


def _model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_recomputed_log_probs_agree_with_the_engine_s_rollout_log_probs(engine, model_dir, temperature):
    samples = _rollouts(engine, ["What is 12 + 30?", "What is 7 * 8?"], 3, temperature)
    b = make_batch(samples, [0.0] * len(samples))
    with torch.no_grad():
        new = token_logprobs(_model(model_dir), b.ids, b.attention, temperature)
    assert b.mask.sum() == sum(s.response_length for s in samples) > 0
    assert float(((new - b.old_logp).abs() * b.mask).max()) < 1e-4
    # at the wrong temperature they do not: the check can fail
    with torch.no_grad():
        other = token_logprobs(_model(model_dir), b.ids, b.attention, temperature + 0.5)
    assert float(((other - b.old_logp).abs() * b.mask).max()) > 1e-3


def test_a_step_starts_on_policy_raises_the_rewarded_samples_and_the_engine_serves_the_saved_weights(
        engine, model_dir, tmp_path):
    torch.manual_seed(0)
    samples = _rollouts(engine, ["What is 40 + 2?"], 4, 1.0)
    # the first sample's answer is rewarded, every other answer not: two samples that drew the same tokens
    # get the same reward (sampling at temperature 1 can repeat an answer)
    answers = [tuple(s.tokens[-s.response_length:]) for s in samples]
    rewarded = [i for i, a in enumerate(answers) if a == answers[0]]
    others = [i for i, a in enumerate(answers) if a != answers[0]]
    assert others, answers
    for i, s in enumerate(samples):
        s.reward = {"score": 1.0 if i in rewarded else 0.0}
    model = _model(model_dir)
    trainer = GRPOTrainer(model, lr=1e-2, micro_steps=1)
    before = make_batch(samples, [0.0] * 4)
    with torch.no_grad():
        old = (token_logprobs(model, before.ids, before.attention) * before.mask).sum(-1)
    m = trainer.step([samples])
    assert m["logprob_diff_first"] < 1e-4 and m["samples"] == 4.0
    with torch.no_grad():
        new = (token_logprobs(model, before.ids, before.attention) * before.mask).sum(-1)
    moved = new - old
    assert moved[rewarded].min() > moved[others].max()  # rewarded responses gained against the others

    folder = trainer.save(tmp_path / "step-1")
    version_before = engine._version
    reply = asyncio.run(engine.update_weights_from_disk(str(folder)))
    assert reply["ok"] and reply["version"] == version_before + 1
    fresh = _rollouts(engine, ["What is 40 + 2?"], 2, 1.0)
    assert {s.metadata["weight_version"] for s in fresh} == {version_before + 1}
    b = make_batch(fresh, [0.0] * len(fresh))
    with torch.no_grad():
        served = token_logprobs(model, b.ids, b.attention)
    assert float(((served - b.old_logp).abs() * b.mask).max()) < 1e-4  # the engine samples from the new weights
