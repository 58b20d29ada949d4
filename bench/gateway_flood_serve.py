"""A rollout step's own latency under hostile gateway traffic, through Serve's proxy (issue 32, point 4).

    python bench/gateway_flood_serve.py [--steps 2] [--unauth 8]

The local recipe's Serve app starts as ``rayapp run`` starts it (``rayapp.cli.local_app``: a Ray head on
127.0.0.1 with logical GPUs and Ray's token authentication, ``serve run``, a free HTTP port), and is
stopped at the end with its cluster. The driver here asks for rollout steps through the manager's handle
and times each: one to warm up (not counted), ``--steps`` alone, then ``--steps`` while a client in
another process sends ``--unauth`` bodies of 30 MB without a valid key to the gateway route through
Serve's proxy, in rounds until the last step ends. Meanwhile a thread asks ``GET /healthz`` through the
proxy every 0.25 s and reads the resident memory of the proxy and of the manager replica from /proc.
Printed: each phase's step times and ``/healthz`` latencies, the ratio of the mean step time under the
flood to the quiet one, the flood's answers and how long each took, and the two processes' peak RSS per
phase. The recipe runs no gateway agent, so there is no episode key to send a large body with: that part
of ``bench/gateway_flood.py`` (a 10 MB message over an episode's context) is not sent here. Figures only
(docs/agents.md has a run's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replica_memory import SLOW_MACHINE_ENV, read_memory, recipe_file

from rayapp.cli.local_cluster import LOCAL_ENV, local_app, ray_processes

STEP_TIMEOUT_S = 900.0
BODY_MB = 30


def flood(url: str, unauth: int, stop: str) -> None:
    """The other process: rounds of ``unauth`` 30 MB bodies with a wrong key until ``stop`` exists; prints
    each answer (a status, or the error that ended the upload) and its seconds as one JSON line."""
    import asyncio

    import httpx

    body = b"x" * (BODY_MB << 20)

    async def post(c: httpx.AsyncClient) -> tuple[str, float]:
        t = time.monotonic()
        try:
            r = await c.post(f"{url}/gateway/flood/v1/chat/completions", content=body,
                             headers={"Authorization": "Bearer wrong", "Content-Type": "application/json"},
                             timeout=600)
            return str(r.status_code), time.monotonic() - t
        except httpx.HTTPError as e:  # the server answered and closed before the body was sent whole
            return type(e).__name__, time.monotonic() - t

    async def main() -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
            while not out or not os.path.exists(stop):
                out += await asyncio.gather(*(post(c) for _ in range(unauth)))
        return out

    print(json.dumps(asyncio.run(main())))


def figures(xs: list[float], unit: float = 1e3, name: str = "ms") -> str:
    if not xs:
        return "(none)"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
    return (f"p50 {statistics.median(xs) * unit:8.1f} {name}   p99 {p99 * unit:8.1f} {name}   "
            f"max {xs[-1] * unit:8.1f} {name}   (n {len(xs)})")


class Watch(threading.Thread):
    """``GET /healthz`` through the proxy every 0.25 s, and the proxy's and the manager's RSS, each sample
    tagged with the phase it fell in."""

    def __init__(self, url: str, temp_dir: Path):
        super().__init__(daemon=True)
        self.url, self.temp_dir, self.phase = url, temp_dir, "warm"
        self.health: list[tuple[str, float]] = []
        self.rss: list[tuple[str, str, float]] = []
        self.done = threading.Event()

    def pids(self) -> dict[str, int]:
        found = {}
        for pid in ray_processes(self.temp_dir):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::ProxyActor"):
                found["proxy"] = pid
            elif title.startswith("ray::ServeReplica:rayapp:SchedulerRolloutManager"):
                found["manager"] = pid
        return found

    def run(self) -> None:
        import httpx

        pids = self.pids()
        with httpx.Client() as c:
            while not self.done.is_set():
                t = time.monotonic()
                try:
                    ok = c.get(f"{self.url}/healthz", timeout=120).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.health.append((self.phase if ok else f"{self.phase} (failed)", time.monotonic() - t))
                for who, pid in pids.items():
                    with contextlib.suppress(OSError, ValueError):  # the process ended meanwhile
                        self.rss.append((self.phase, who, read_memory(pid)[0]))
                self.done.wait(max(0.0, 0.25 - (time.monotonic() - t)))


def pin(temp_dir: Path, proxy_cpus: set[int], other_cpus: set[int]) -> dict[str, int]:
    """``--pin``: every thread of Serve's proxy on ``proxy_cpus`` (the flood client joins it there), every other
    process of the cluster (engine, manager, pool, Ray's own) on ``other_cpus``: then what the flood costs the
    proxy and its client cannot be taken from the step's CPU. Returns how many processes went where."""
    placed = {"proxy": 0, "rest": 0}
    for pid in ray_processes(temp_dir):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            cpus, who = (proxy_cpus, "proxy") if title.startswith("ray::ProxyActor") else (other_cpus, "rest")
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(tid), cpus)
            placed[who] += 1
        except OSError:
            continue
    return placed


def run(args: argparse.Namespace) -> None:
    os.environ.update(LOCAL_ENV)  # before Ray's import (127.0.0.1 stays 127.0.0.1)
    for k, v in SLOW_MACHINE_ENV.items():
        os.environ.setdefault(k, v)
    import ray
    import yaml

    from rayapp.connection import manager_handle

    tmp = Path(tempfile.mkdtemp(prefix="rayapp-flood-"))
    temp_dir = Path(f"/tmp/rayapp-flood-{os.getpid()}")
    recipe = recipe_file(tmp, None)
    cfg = yaml.safe_load(recipe.read_text())
    url = f"http://127.0.0.1:{cfg['http_options']['port']}{cfg['applications'][0]['route_prefix']}"
    batch = cfg["applications"][0]["args"]["scheduler"]["rollout_batch_size"]
    print(f"serve log: {tmp / 'serve.log'}", flush=True)
    steps: dict[str, list[float]] = {"quiet": [], "flood": []}
    with local_app(recipe, temp_dir, tmp / "serve.log", timeout_s=900) as (address, _):
        ray.init(address=address, namespace="rayapp-flood", logging_level="error", log_to_driver=False)
        watch, client, stop = Watch(url, temp_dir), None, tmp / "stop"
        try:
            handle = manager_handle("rayapp", 300)
            if args.pin:
                print(f"pinned (proxy on CPU 1, the rest on CPU 0): {pin(temp_dir, {1}, {0})}", flush=True)
            watch.start()
            t = time.monotonic()
            handle.generate.remote(0).result(timeout_s=STEP_TIMEOUT_S)
            print(f"warm-up step: {time.monotonic() - t:.1f} s", flush=True)
            rid = 1
            for phase in ("quiet", "flood"):
                watch.phase = phase
                if phase == "flood":
                    cmd = [sys.executable, __file__, "--client", url, str(args.unauth), str(stop)]
                    client = subprocess.Popen(["taskset", "-c", "1", *cmd] if args.pin else cmd,
                                              stdout=subprocess.PIPE, text=True)
                    time.sleep(1.0)  # the first round under way
                for _ in range(args.steps):
                    t = time.monotonic()
                    handle.generate.remote(rid).result(timeout_s=STEP_TIMEOUT_S)
                    steps[phase].append(time.monotonic() - t)
                    print(f"{phase} step {rid}: {steps[phase][-1]:.1f} s", flush=True)
                    rid += 1
            stop.touch()
            out, _ = client.communicate(timeout=600)
            watch.phase = "after"
            time.sleep(2.0)
        finally:
            watch.done.set()
            if client is not None and client.poll() is None:  # a step failed: the flood must not go on
                client.kill()
            ray.shutdown()
    answers = json.loads(out.strip().splitlines()[-1])
    print(f"\nlocal recipe, rollout steps of {batch} groups through the manager's handle; flood: {args.unauth} x "
          f"{BODY_MB} MB without a valid key to {url}/gateway/... through Serve's proxy, in rounds "
          f"({len(answers) // args.unauth} rounds)")
    for phase in ("quiet", "flood"):
        print(f"{phase:6s} step      {' '.join(f'{s:.1f}' for s in steps[phase])} s (mean "
              f"{statistics.mean(steps[phase]):.1f} s)")
    ratio = statistics.mean(steps["flood"]) / statistics.mean(steps["quiet"])
    print(f"ratio  step time under flood / quiet: {ratio:.2f}")
    for phase in ("quiet", "flood"):
        print(f"{phase:6s} /healthz  {figures([s for p, s in watch.health if p == phase])}")
    failed = Counter(p for p, _ in watch.health if p.endswith("(failed)"))
    if failed:
        print(f"/healthz failures: {dict(failed)}")
    print(f"flood answers {dict(sorted(Counter(a for a, _ in answers).items()))}; each took "
          f"{figures([s for _, s in answers], 1.0, 's')}")
    for who in ("proxy", "manager"):
        peaks = {p: max((r for ph, w, r in watch.rss if w == who and ph == p), default=float("nan"))
                 for p in ("warm", "quiet", "flood", "after")}
        print(f"{who:8s} peak RSS " + ", ".join(f"{p} {v:.0f} MB" for p, v in peaks.items()))
    print("not sent: a 10 MB message with a valid episode key (the local recipe runs no gateway agent: no key)")


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        url, unauth, stop = sys.argv[2:5]
        flood(url, int(unauth), stop)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="timed rollout steps per phase")
    parser.add_argument("--unauth", type=int, default=8, help="30 MB bodies without a key per round")
    parser.add_argument("--pin", action="store_true", help="Serve's proxy and the flood client on CPU 1, the rest of "
                        "the cluster on CPU 0, in both phases: the flood then cannot take the step's CPU")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
