"""rayapp's SGLangBackend against SGLang's own offline throughput benchmark, on one GPU machine.

Both runs use the same model and the same request set: ``--num-prompts`` prompts of exactly
``--input-len`` random token ids (seeded), each generating exactly ``--output-len`` tokens (eos
ignored). rayapp's side submits them all at once through ``SGLangBackend.generate``; SGLang's side is
``python -m sglang.benchmark.offline_throughput --dataset-name random-ids --random-range-ratio 1`` with
the same counts, lengths and seed (its own seeded ids: same shape, not the same integers). Prints
output tokens/s for both and rayapp / sglang. Figures only; nothing here asserts on time.

Run inside the image built from cluster/Dockerfile, on a machine with a GPU:
``python3 bench/gpu_sglang.py [--model PATH_OR_HF_ID]`` (default: rayapp's tiny model). With no GPU it
exits 2. NOT RUN on the machines this project is developed on (no GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NO_GPU_EXIT = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder or Hugging Face id (default: rayapp's tiny model)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens, exact")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt, exact")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=0.8)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="limit for each of the two runs")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "tp_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def gpu_missing() -> str | None:
    """Why this machine cannot run the benchmark, or None when it can."""
    try:
        import torch
    except ImportError:
        return "torch is not installed (use the image built from cluster/Dockerfile)"
    if not torch.cuda.is_available():
        return f"no CUDA GPU visible to torch {torch.__version__}"
    return None


def make_requests(vocab_size: int, args: argparse.Namespace) -> list:
    from rayapp.inference.client import GenerateRequest
    from rayapp.types import SamplingParams

    rng = random.Random(args.seed)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.output_len)
    return [GenerateRequest(input_ids=[rng.randrange(vocab_size) for _ in range(args.input_len)],
                            sampling=sampling, request_id=f"bench-{i}", ignore_eos=True)
            for i in range(args.num_prompts)]


async def _generate_all(backend, requests, timeout_s: float) -> tuple[int, float]:
    start = time.perf_counter()
    outs = await asyncio.wait_for(asyncio.gather(*(backend.generate(r) for r in requests)), timeout_s)
    return sum(len(o.output_ids) for o in outs), time.perf_counter() - start


def run_rayapp(model: str, args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    from rayapp.inference.sglang import SGLangBackend

    requests = make_requests(AutoConfig.from_pretrained(model).vocab_size, args)
    backend = SGLangBackend(model, tp_size=args.tp_size, mem_fraction_static=args.mem_fraction_static)
    try:
        asyncio.run(_generate_all(backend, requests[:1], args.timeout_s))  # warm-up, as sglang's side does
        tokens, seconds = asyncio.run(_generate_all(backend, requests, args.timeout_s))
    finally:
        backend.shutdown()
    return {"output_tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds}


def run_sglang(model: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.jsonl"
        cmd = [sys.executable, "-m", "sglang.benchmark.offline_throughput", "--model-path", model,
               "--dataset-name", "random-ids", "--num-prompts", str(args.num_prompts),
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--random-range-ratio", "1.0", "--seed", str(args.seed), "--tp-size", str(args.tp_size),
               "--mem-fraction-static", str(args.mem_fraction_static), "--result-filename", str(result)]
        subprocess.run(cmd, check=True, timeout=args.timeout_s)
        last = json.loads(result.read_text().splitlines()[-1])
    return {"output_tokens": last["total_output_tokens"], "seconds": last["total_latency"],
            "tok_s": last["output_throughput"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = gpu_missing()
    if why is not None:
        print(f"bench/gpu_sglang.py needs a GPU machine: {why}; nothing was run", file=sys.stderr)
        return NO_GPU_EXIT
    if args.model is None:
        from rayapp.inference.tiny_model import ensure_tiny_model

        args.model = str(ensure_tiny_model())
    ours = run_rayapp(args.model, args)
    theirs = run_sglang(args.model, args)
    print(f"model {args.model}: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, "
          f"seed {args.seed}, tp {args.tp_size}")
    print(f"{'run':<40} {'output tokens':>14} {'seconds':>9} {'tok/s':>10}")
    for name, r in (("rayapp SGLangBackend.generate", ours), ("sglang.benchmark.offline_throughput", theirs)):
        print(f"{name:<40} {r['output_tokens']:>14} {r['seconds']:>9.2f} {r['tok_s']:>10.1f}")
    print(f"{'rayapp / sglang':<40} {'':>14} {'':>9} {ours['tok_s'] / theirs['tok_s']:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
