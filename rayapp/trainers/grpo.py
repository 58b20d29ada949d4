"""A small GRPO trainer for the hf backend's models: the maths of one policy update, on CPU.

GRPO (group relative policy optimisation) needs no value model: every prompt is sampled ``k``
times (a group), and a sample's advantage is its reward against its group's, normalised by the
group's spread. The update is PPO's clipped surrogate on each response token the agent produced
(``loss_mask``), with the ratio taken against the engine's own ``rollout_log_probs``:

    ratio = exp(logp_new - logp_rollout)
    loss  = -mean over masked tokens of min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)

The log-probs are recomputed the way ``rayapp.inference.sampling`` reports them (``log_softmax``
of the logits divided by the temperature, over the full vocabulary), so before the first optimiser
step the recomputed values equal the rollout's up to float noise. ``GRPOTrainer.step`` reports the
largest difference at every micro-step: a large one at the first shows tokens and log-probs that do
not line up (a shifted mask, a re-tokenised response, a different temperature), which silently
breaks training. Pure torch: no Ray here; the driver moves samples and weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rayapp.types import Sample


def group_advantages(rewards: Sequence[Sequence[float]], eps: float = 1e-6) -> list[list[float]]:
    """Per group: ``(r - mean) / (std + eps)`` (population std). A group whose rewards are all equal
    teaches nothing and gets zeros."""
    out = []
    for group in rewards:
        r = torch.tensor(list(group), dtype=torch.float64)
        if r.numel() == 0:
            out.append([])
            continue
        centred = r - r.mean()
        std = r.std(unbiased=False)
        out.append((centred / (std + eps)).tolist() if std > 0 else [0.0] * r.numel())
    return out


def clipped_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                 clip_eps: float = 0.2, n_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate over ``[batch, length]`` tensors (``advantages`` per row, broadcast
    over the row's tokens). Only tokens where ``mask`` is 1 count; the sum is divided by ``n_tokens``
    (default: the masked tokens here), so micro-batches of one batch can share one denominator."""
    mask = mask.to(new_logp.dtype)
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages.to(new_logp.dtype).unsqueeze(-1)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    denom = float(n_tokens) if n_tokens is not None else max(1.0, float(mask.sum()))
    loss = -(surrogate * mask).sum() / denom
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).to(mask.dtype) * mask
        stats = {"clip_frac": float(clipped.sum() / max(1.0, float(mask.sum()))),
                 "ratio_max": float((ratio * mask).max()) if mask.any() else 1.0}
    return loss, stats


@dataclass
class Batch:
    """Right-padded tensors of a list of samples: ``ids`` ``[B, T]``; ``old_logp``, ``mask`` ``[B, T-1]``
    aligned with the next-token log-probs (column ``j`` scores token ``j + 1``); one advantage per row."""

    ids: torch.Tensor
    attention: torch.Tensor
    old_logp: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor


def make_batch(samples: Sequence[Sample], advantages: Sequence[float], pad_id: int = 0) -> Batch:
    """Samples as tensors. A sample's ``rollout_log_probs`` and ``loss_mask`` cover its last
    ``response_length`` tokens (``rayapp.types.Sample``); any other length is refused."""
    if len(samples) != len(advantages):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    width = max(len(s.tokens) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    old = torch.zeros((len(samples), width - 1), dtype=torch.float32)
    mask = torch.zeros_like(old)
    for row, s in enumerate(samples):
        n, r = len(s.tokens), s.response_length
        if not 0 < r < n or len(s.rollout_log_probs) != r or len(s.loss_mask) != r:
            raise ValueError(f"sample {s.task_id}#{s.index}: {n} tokens, response_length {r}, "
                             f"{len(s.rollout_log_probs)} log-probs, {len(s.loss_mask)} mask entries; "
                             "log-probs and mask must cover the response exactly")
        ids[row, :n] = torch.tensor(s.tokens)
        attention[row, :n] = 1
        old[row, n - r - 1:n - 1] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
        mask[row, n - r - 1:n - 1] = torch.tensor(s.loss_mask, dtype=torch.float32)
    return Batch(ids, attention, old, mask, torch.tensor(list(advantages), dtype=torch.float32))


def token_logprobs(model: Any, ids: torch.Tensor, attention: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, T-1]``: the log-prob of token ``j + 1`` given tokens ``0..j``, as the engine samples it
    (``log_softmax(logits / temperature)``; the raw logits for temperature 0)."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class GRPOTrainer:
    """Holds the policy and its optimiser. ``step(groups)`` is one GRPO update on one rollout:
    advantages per group, then ``micro_steps`` optimiser steps on equal slices of the samples (the
    first on-policy, the later ones off-policy by one step or more, where the clip matters)."""

    def __init__(self, model: Any, lr: float = 1e-3, clip_eps: float = 0.2, temperature: float = 1.0,
                 micro_steps: int = 2, max_grad_norm: float = 1.0, pad_id: int = 0):
        if micro_steps < 1:
            raise ValueError(f"micro_steps must be >= 1, got {micro_steps}")
        self.model, self.clip_eps, self.temperature = model, clip_eps, temperature
        self.micro_steps, self.max_grad_norm, self.pad_id = micro_steps, max_grad_norm, pad_id
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.99))

    def step(self, groups: Sequence[Sequence[Sample]], reward_key: str = "score") -> dict[str, float]:
        """One update. Samples without a response (aborted, empty) are left out; a group keeps its
        advantages from all its scored members. Returns the step's figures, ``logprob_diff_first``
        (before any update) and ``logprob_diff_max`` (over all micro-steps) among them."""
        rewards = [[float(s.reward.get(reward_key, 0.0)) for s in g] for g in groups]
        pairs = [(s, a) for g, adv in zip(groups, group_advantages(rewards), strict=True)
                 for s, a in zip(g, adv, strict=True) if s.response_length > 0 and any(s.loss_mask)]
        metrics = {"reward_mean": sum(map(sum, rewards)) / max(1, sum(map(len, rewards))),
                   "samples": float(len(pairs)), "logprob_diff_first": 0.0, "logprob_diff_max": 0.0,
                   "loss": 0.0, "clip_frac": 0.0}
        live = [p for p in pairs if p[1] != 0.0]  # zero advantage: no gradient, only cost
        if not live:
            return metrics
        self.model.train()
        slices = [live[i::self.micro_steps] for i in range(self.micro_steps) if live[i::self.micro_steps]]
        for i, part in enumerate(slices):
            b = make_batch([s for s, _ in part], [a for _, a in part], self.pad_id)
            new = token_logprobs(self.model, b.ids, b.attention, self.temperature)
            diff = float(((new.detach() - b.old_logp).abs() * b.mask).max())
            if i == 0:
                metrics["logprob_diff_first"] = diff
            metrics["logprob_diff_max"] = max(metrics["logprob_diff_max"], diff)
            loss, stats = clipped_loss(new, b.old_logp, b.advantages, b.mask, self.clip_eps)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.opt.step()
            metrics["loss"] += loss.item() / len(slices)
            metrics["clip_frac"] += stats["clip_frac"] / len(slices)
        self.model.eval()
        return metrics

    def save(self, folder: str | Path) -> Path:
        """The weights as safetensors in a model folder, the layout ``update_weights_from_disk`` of the
        hf backend reads (and ``from_pretrained`` loads)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        from rayapp.inference.tiny_model import quiet_progress

        with quiet_progress():
            self.model.save_pretrained(folder, safe_serialization=True)
        return folder
