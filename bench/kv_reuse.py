"""The hf engine's prefix cache on a multi-turn episode: per-turn latency with and without reuse.

One episode of ``--turns`` greedy turns on the tiny model, each turn's prompt the whole history so far
(the previous prompt, the model's tokens, then an environment message), as the agents and the
gateway send it. The same episode runs on two engines in this process, one with the prefix cache
(each turn prefills only what is new since the last) and one without (each turn prefills its whole
context), each first on every other turn, best of ``--rounds``; printed per turn with the context length,
then the whole episode. Both must generate the same tokens (checked). Figures only.

Run from the repo root: ``.venv/bin/python bench/kv_reuse.py [--turns N] [--rounds R] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayapp.inference import GenerateRequest
from rayapp.inference.hf import HFBackend
from rayapp.types import SamplingParams

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
# what a tool answers between turns (about 70 tokens: a short file listing and a test summary)
OBSERVATION = ("\ntool: ok. files: " + " ".join(f"src/mod_{i}.py" for i in range(2)) +
               "; tests passed: 41, failed: 1.\nuser: add {n} more, please, and say the total.\nassistant:")


def turn(backend: HFBackend, ids: list[int]) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = asyncio.run(backend.generate(GenerateRequest(input_ids=list(ids), sampling=GREEDY)))
    return list(out.output_ids), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    args = ap.parse_args()
    if args.smoke:
        args.turns, args.rounds = 2, 1
    cached, plain = HFBackend(seed=0), HFBackend(seed=0, prefix_cache=0)
    tok = cached.tokenizer
    first = tok.apply_chat_template([{"role": "user", "content": "A long task: add up the numbers we are given, "
                                      "one message at a time, and say the running total each time. Start at 3."}],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    for engine in (cached, plain):  # warm: the first forward pass of a process is slow
        turn(engine, first)
    best: list[list[float]] = [[float("inf")] * 2 for _ in range(args.turns)]
    lengths: list[int] = []
    for _ in range(args.rounds):
        cached._prefix.clear()
        ids, lengths = list(first), []
        for t in range(args.turns):
            if t % 2:  # each goes first on every other turn
                out_p, took_p = turn(plain, ids)
                out_c, took_c = turn(cached, ids)
            else:
                out_c, took_c = turn(cached, ids)
                out_p, took_p = turn(plain, ids)
            if out_c != out_p:
                raise SystemExit(f"turn {t + 1}: the cached engine generated other tokens: {out_c} vs {out_p}")
            best[t] = [min(best[t][0], took_c), min(best[t][1], took_p)]
            lengths.append(len(ids))
            ids += out_c + tok.encode(OBSERVATION.format(n=t + 4), add_special_tokens=False)
    print(f"one {args.turns}-turn episode, greedy, {GREEDY.max_new_tokens} new tokens a turn at most, best of "
          f"{args.rounds}; ms per turn")
    print(f"{'turn':>4} {'context':>8} {'reuse':>8} {'no reuse':>9} {'speed-up':>9}")
    for t, ((c, p), n) in enumerate(zip(best, lengths, strict=True), 1):
        print(f"{t:>4} {n:>8} {c * 1e3:>8.1f} {p * 1e3:>9.1f} {p / c:>8.2f}x")
    total_c, total_p = sum(b[0] for b in best), sum(b[1] for b in best)
    print(f"episode: {total_c * 1e3:.0f} ms with reuse, {total_p * 1e3:.0f} ms without: {total_p / total_c:.2f}x; "
          f"last turn {best[-1][1] / best[-1][0]:.2f}x")
    cached.shutdown()
    plain.shutdown()


if __name__ == "__main__":
    main()
