"""Choosing the next token from a row of logits, and the log-prob a trainer recomputes for it.

For temperature > 0 the log-prob is ``log_softmax(logits / temperature)`` over the full vocabulary,
before top-k/top-p filtering (the filters shape what is drawn, not what is reported); for greedy
(temperature 0) it is the ``log_softmax`` of the raw logits. A log-prob is never above 0.
"""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
                generator: torch.Generator | None) -> tuple[int, float]:
    """One token from a 1-D logits row, and its log-prob (see the module docstring for which)."""
    logits = logits.float()
    if temperature == 0:
        token = int(torch.argmax(logits))
        return token, min(0.0, float(torch.log_softmax(logits, -1)[token]))
    logp = torch.log_softmax(logits / temperature, -1)
    probs = logp.exp()
    keep = torch.ones_like(probs, dtype=torch.bool)
    if 0 < top_k < probs.numel():
        keep = torch.zeros_like(keep)
        keep[torch.topk(probs, top_k).indices] = True
    if top_p < 1.0:
        masked = torch.where(keep, probs, 0.0)
        sorted_p, order = torch.sort(masked, descending=True)
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the tokens ranked above each one
        in_nucleus = before < top_p * sorted_p.sum()
        in_nucleus[0] = True
        keep = torch.zeros_like(keep)
        keep[order[in_nucleus]] = True
    token = int(torch.multinomial(torch.where(keep, probs, 0.0), 1, generator=generator))
    return token, min(0.0, float(logp[token]))
