"""The gateway's event loop under hostile traffic: how long the loop stalls, and what a cheap call
costs, while large and unauthenticated bodies arrive (issue 32, point 4). One process, no Ray.

The gateway's routes are served by uvicorn on 127.0.0.1 in this process's loop, as the manager's
ingress serves them, over an engine that answers at once (the tiny model's tokenizer). A ticker on
the loop sleeps 10 ms at a time and records how late it wakes (the loop's lag). A client in another
process (so its own work is not on the measured loop) makes cheap chat calls one after another on a
quiet episode: first alone, then while it floods the gateway with ``--unauth`` bodies of 30 MB
without a key, ``--over`` 10 MB messages with a valid key to an episode of ``max_context_len`` 4096,
and ``--large`` 1 MB messages with a valid key to an episode without a context bound (decoded,
templated and tokenized whole), in rounds for at least as long as the quiet phase. Printed: per
phase, the loop's lag and the cheap call's latency (p50 / p99 / max), and this process's peak resident
memory before and after the flood. Figures only.

Run from the repo root: ``.venv/bin/python bench/gateway_flood.py [--smoke]`` (docs/agents.md has a run's figures).
"""

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))



def client(url: str, keys: dict[str, str], unauth: int, over: int, large: int, quiet_s: float) -> None:
    """The other process: cheap calls alone, then with the flood; prints the phases' latencies."""
    import httpx

    cheap = json.dumps({"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
                        "max_tokens": 4}).encode()

    def body(n: int) -> bytes:
        return json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * (n // 5)}]}).encode()

    async def post(c: httpx.AsyncClient, episode: str, key: str, data: bytes) -> str:
        try:
            r = await c.post(f"{url}/{episode}/v1/chat/completions", content=data,
                             headers={"Authorization": f"Bearer {key}"}, timeout=600)
            return str(r.status_code)
        except httpx.HTTPError as e:  # a body refused before it was sent whole: the server closed the connection
            return type(e).__name__

    async def cheap_calls(c: httpx.AsyncClient, until: asyncio.Future | float) -> list[float]:
        out = []
        while (time.monotonic() < until) if isinstance(until, float) else not until.done():
            t = time.monotonic()
            r = await c.post(f"{url}/quiet/v1/chat/completions", content=cheap,
                             headers={"Authorization": f"Bearer {keys['quiet']}"}, timeout=600)
            assert r.status_code == 200, r.text
            out.append(time.monotonic() - t)
        return out

    unauth_body, over_body, large_body = b"x" * (30 << 20), body(10 << 20), body(1 << 20)  # made before the clock

    async def flood(c: httpx.AsyncClient) -> list[str]:
        statuses, until = [], time.monotonic() + quiet_s
        while not statuses or time.monotonic() < until:  # rounds for as long as the quiet phase, one at least
            statuses += await asyncio.gather(*(post(c, "quiet", "wrong", unauth_body) for _ in range(unauth)),
                                             *(post(c, "bounded", keys["bounded"], over_body) for _ in range(over)),
                                             *(post(c, "open", keys["open"], large_body) for _ in range(large)))
        return statuses

    async def main() -> dict:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
            t0 = time.time()
            quiet = await cheap_calls(c, time.monotonic() + quiet_s)
            t1 = time.time()
            flooding = asyncio.ensure_future(flood(c))
            loud = await cheap_calls(c, flooding)
            return {"phases": [t0, t1, time.time()], "quiet": quiet, "flood": loud, "statuses": flooding.result()}

    print(json.dumps(asyncio.run(main())))


def figures(xs: list[float]) -> str:
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return (f"p50 {statistics.median(xs) * 1e3:8.1f} ms   p99 {p99 * 1e3:8.1f} ms   "
            f"max {xs[-1] * 1e3:8.1f} ms   (n {len(xs)})")


async def serve(args: argparse.Namespace) -> None:
    import uvicorn
    from fastapi import FastAPI

    from rayapp.episode import EpisodeContext
    from rayapp.gateway.routes import gateway_router
    from rayapp.gateway.service import EpisodeBinding, Gateway
    from rayapp.inference.client import FinishReason, GenerateOutput
    from rayapp.inference.tiny_model import ensure_tiny_model, load_tokenizer
    from rayapp.types import SamplingParams, StoppingCriteria

    tok = load_tokenizer(ensure_tiny_model())
    answer = [*tok.encode("4", add_special_tokens=False), tok.eos_token_id]

    class Instant:
        async def info(self) -> dict:
            return {}

        async def generate(self, req, timeout_s=None):
            return GenerateOutput(req.request_id, answer, [-0.1] * len(answer), FinishReason.STOP, "4",
                                  len(req.input_ids), "instant", "0")

    app = FastAPI()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/gateway"
    gateway = Gateway(url)
    app.include_router(gateway_router(gateway))
    keys = {}
    for name, limit in (("quiet", None), ("bounded", 4096), ("open", None)):
        ctx = EpisodeContext(0, None, StoppingCriteria(max_turns=10**6, max_context_len=limit),
                             SamplingParams(max_new_tokens=8))
        keys[name] = gateway.open(EpisodeBinding(name, Instant(), tok, ctx))[1]

    lags: list[tuple[float, float]] = []

    async def ticker() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lags.append((time.time(), time.monotonic() - t - 0.01))

    ticking = asyncio.ensure_future(ticker())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    argv = [sys.executable, __file__, "--client", url, json.dumps(keys), str(args.unauth), str(args.over),
            str(args.large), str(args.quiet_s)]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ticking.cancel()
    server.should_exit = True
    await task
    got = json.loads(out.decode().strip().splitlines()[-1])
    t0, t1, t2 = got["phases"]
    print(f"flood: {args.unauth} x 30 MB without a key, {args.over} x 10 MB over a 4,096-token context, "
          f"{args.large} x 1 MB to an unbounded episode, in rounds; answers "
          f"{dict(sorted(Counter(got['statuses']).items()))}")
    for phase, (a, b) in (("quiet", (t0, t1)), ("flood", (t1, t2))):
        print(f"{phase:6s} loop lag    {figures([lag for t, lag in lags if a <= t < b])}")
        print(f"{phase:6s} cheap call  {figures(got[phase])}")
    print(f"flood took {t2 - t1:.1f} s; peak RSS {rss_before / 1024:.0f} MB before, {rss_after / 1024:.0f} MB after")


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        url, keys, unauth, over, large, quiet_s = sys.argv[2:8]
        client(url, json.loads(keys), int(unauth), int(over), int(large), float(quiet_s))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="one body of each kind")
    parser.add_argument("--unauth", type=int, default=8)
    parser.add_argument("--over", type=int, default=1)
    parser.add_argument("--large", type=int, default=2)
    parser.add_argument("--quiet-s", type=float, default=5.0, help="seconds of cheap calls alone")
    args = parser.parse_args()
    if args.smoke:
        args.unauth, args.over, args.large, args.quiet_s = 1, 1, 1, 1.0
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
