"""``rayapp try RECIPE``: a recipe's steps in this one process, without Ray, to see the samples a
trainer would get before any cluster starts (docs/try.md).

The recipe is read as ``rayapp validate`` reads it (``load_recipe``: a bad recipe is the same one
line) and wired by the same ``build_step_runner`` the Serve manager calls; only what the host lends
differs. Here it is: each engine's hf backend in this process behind ``LocalEngine`` (the calls an
agent makes of the manager's ``EngineClient``), the core ``PlacementPool`` over the recipe's layout
(or one node of ``--num-gpus`` logical GPUs, as ``rayapp run``'s head has), function calls in worker
threads (``run_inline``), sandboxes opened here (``make_sandbox``), and, for a recipe with a
``gateway:`` evaluator, the agent gateway's routes served by uvicorn on a free 127.0.0.1 port.

An sglang engine is refused: it needs GPUs and its own server processes, which is what the cluster
path is for, and a laptop trying a recipe has neither.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import msgspec

from rayapp.core.termination import AgentTimeout
from rayapp.trainers.converters import EpisodeKey
from rayapp.types import Sample

HF_ONLY = ("rayapp try runs hf engines only, in its own process; an sglang engine needs GPUs and its "
           "server processes: run this recipe with rayapp run (or serve run)")
STEP_TIMEOUT_S = 900.0  # one step, end to end; `--timeout` changes it
GATEWAY_START_S = 30.0


class LocalEngine:
    """A backend in this process, with the calls an agent makes of the manager's ``EngineClient``:
    ``generate`` bounded by the engine's ``request_timeout_s`` (past it: ``AgentTimeout``), ``info``
    (its ``tokenizer_path`` is on this machine already), ``abort`` (a cut-short turn) and ``health``."""

    def __init__(self, backend: Any, name: str, timeout_s: float):
        self.backend, self.name, self.timeout_s = backend, name, timeout_s

    async def generate(self, req: Any, timeout_s: float | None = None) -> Any:
        bound = timeout_s or self.timeout_s
        try:
            return await asyncio.wait_for(self.backend.generate(req), bound)
        except TimeoutError:
            raise AgentTimeout(f"engine {self.name}.generate gave no answer within {bound:g}s") from None

    async def info(self) -> dict:
        return self.backend.info()

    async def abort(self, request_id: str | None = None) -> int:
        return await self.backend.abort(request_id)

    async def health(self) -> dict:
        return await self.backend.health()


def start_engine(name: str, e: Any, source: str | os.PathLike, root: str) -> LocalEngine:
    """Engine ``name``'s backend, started in this process; an sglang engine, or an hf backend that
    cannot start (its model folder missing), is one RecipeError naming the engine's field."""
    from rayapp.inference.backends import make_backend
    from rayapp.recipe import RecipeError

    if e.backend != "hf":
        raise RecipeError(source, f"{root}.engines.{name}.backend", f"{e.backend!r}: {HF_ONLY}")
    try:
        return LocalEngine(make_backend("hf", **e.options), name, e.request_timeout_s)
    except (ValueError, OSError) as err:
        said = " ".join(str(err).split())  # transformers' messages run over lines: one line here
        raise RecipeError(source, f"{root}.engines.{name}.options", f"the hf backend could not start: {said}") from None


def local_pool(cfg: Any, num_gpus: int, num_cpus: float) -> Any:
    """The core placement pool over the recipe's layout; without one (``cluster_layout: null`` reads
    the live cluster), one node of ``num_gpus`` logical GPUs and the pool's CPUs and memory (else
    ``num_cpus`` and this machine's memory). None when the recipe gates nothing (``pool.gate: false``)."""
    from rayapp.core.layout import parse_cluster_layout
    from rayapp.core.pool import PlacementPool
    from rayapp.types import NodeSpec

    p = cfg.pool
    if not p.gate:
        return None
    layout = parse_cluster_layout(p.cluster_layout, p.num_cpus or 0.0, p.memory_gb or 0.0)
    if layout is None:
        memory_gb = p.memory_gb or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
        layout = {"local": NodeSpec(gpus=tuple(range(num_gpus)), cpu=float(p.num_cpus or num_cpus),
                                    memory_gb=float(memory_gb))}
    return PlacementPool(layout)


async def open_local_sandbox(token: Any, *, kind: str, limits: Any, **kw: Any) -> Any:
    """The host's ``open_sandbox``: a sandbox in this process's machine (no bundle to place it in)."""
    from rayapp.envs.sandboxes import make_sandbox

    return await make_sandbox(kind, limits, **kw)


@contextlib.asynccontextmanager
async def loopback_gateway(cfg: Any) -> AsyncIterator[Any]:
    """The agent gateway, its routes served on a free 127.0.0.1 port while the block runs; None for a
    recipe without a ``gateway:`` evaluator (nothing listens then)."""
    if all(ev.gateway is None for ev in cfg.evaluators):
        yield None
        return
    import uvicorn
    from fastapi import FastAPI

    from rayapp.gateway.routes import gateway_router
    from rayapp.gateway.service import Gateway

    app = FastAPI()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    serving = asyncio.ensure_future(server.serve())
    try:
        async with asyncio.timeout(GATEWAY_START_S):
            while not server.started:
                if serving.done():  # it could not bind: its own error
                    serving.result()
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        gateway = Gateway(f"http://127.0.0.1:{port}/gateway")
        app.include_router(gateway_router(gateway))
        yield gateway
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, GATEWAY_START_S)


def runs(mask: list[int]) -> str:
    """A loss mask as runs, ``1x12 0x5 1x3``: which tokens train, at a glance."""
    out: list[str] = []
    for bit in mask:
        if out and out[-1].startswith(f"{bit}x"):
            out[-1] = f"{bit}x{int(out[-1][2:]) + 1}"
        else:
            out.append(f"{bit}x1")
    return " ".join(out) or "-"


def sample_line(s: Sample) -> str:
    lp = s.rollout_log_probs
    logprobs = f"mean {sum(lp) / len(lp):7.3f} min {min(lp):7.3f}" if lp else "-"
    reason = s.metadata.get(EpisodeKey.TERMINATION_REASON) or "-"  # as the trainer reads it
    score = s.reward.get("score")
    response = s.response if len(s.response) <= 40 else s.response[:37] + "..."
    return (f"  {s.task_id[:28]:<28} {s.index:>3} {'-' if score is None else f'{score:g}':>6} "
            f"{s.status.value:<9} {reason:<16} {len(s.tokens):>6} "
            f"{s.response_length:>5}  {runs(s.loss_mask):<18} {logprobs:<24} {response!r}")


HEADER = (f"  {'task_id':<28} {'idx':>3} {'reward':>6} {'status':<9} {'termination':<16} {'tokens':>6} "
          f"{'resp':>5}  {'loss mask':<18} {'log-probs':<24} response")


def print_step(title: str, groups: Mapping[str, list[Sample]] | list[list[Sample]],
               metrics: Mapping[str, float]) -> None:
    print(f"\n== {title}")
    print(HEADER)
    named = groups.items() if isinstance(groups, Mapping) else ((None, g) for g in groups)
    for name, samples in named:
        if name is not None:
            print(f"  [{name}]")
        for s in samples:
            print(sample_line(s))
    # the step's outcome counts and each dataset's mean reward; the rest (timings) is in --json
    shown = {k: round(v, 4) for k, v in metrics.items()
             if v and (k.count("/") == 1 or k.endswith(("/reward_mean", "/accuracy")))}
    print(f"  metrics: {shown}")


async def run_steps(recipe: Path, args: argparse.Namespace) -> dict[str, list[Any]]:
    """Load and wire the recipe as validate and the manager do, then its steps: rollout k (and eval k
    with ``--eval``) for k in 0 .. rollouts-1. What a trainer would get, by kind."""
    from rayapp.envs.protocol import run_inline
    from rayapp.recipe import apply_env, build_step_runner, load_recipe
    from rayapp.recipe.load import recipe_document

    _, cfg = load_recipe(recipe)
    cfg = apply_env(cfg, os.environ)
    # A try runs fresh steps: a checkpoint folder would serve a finished step again, or overwrite a real run's.
    cfg = msgspec.structs.replace(cfg, scheduler=msgspec.structs.replace(cfg.scheduler, checkpoint_dir=None))
    root = recipe_document(recipe)[2]
    for name, e in cfg.engines.items():  # an sglang engine is refused before any model loads
        if e.backend != "hf":
            start_engine(name, e, recipe, root)
    pool = local_pool(cfg, args.num_gpus, args.num_cpus)
    found: dict[str, list[Any]] = {"rollouts": [], "evals": []}
    engines: dict[str, LocalEngine] = {}
    try:
        for name, e in cfg.engines.items():
            engines[name] = start_engine(name, e, recipe, root)
        async with loopback_gateway(cfg) as gateway:
            steps = build_step_runner(cfg, engines, pool, executor=run_inline, open_sandbox=open_local_sandbox,
                                      gateway=gateway)
            for k in range(args.rollouts):
                result = await asyncio.wait_for(steps.rollout(k), args.timeout)
                found["rollouts"].append(result)
                print_step(f"rollout {k}: {len(result.groups)} groups", result.groups, result.metrics)
                if args.eval and cfg.eval:
                    ev = await asyncio.wait_for(steps.evaluate(k), args.timeout)
                    found["evals"].append(ev)
                    print_step(f"eval {k}: {sum(map(len, ev.samples.values()))} samples", ev.samples, ev.metrics)
    finally:
        for engine in engines.values():
            engine.backend.shutdown()
    return found


def flag_problem(args: argparse.Namespace) -> str | None:
    """The first flag out of its range, said with its value; None when all fit."""
    if args.rollouts < 1:
        return f"--rollouts {args.rollouts}: expected at least 1"
    if not 0 < args.timeout < float("inf"):
        return f"--timeout {args.timeout:g}: expected a positive number of seconds"
    if args.num_gpus < 0:
        return f"--num-gpus {args.num_gpus}: expected 0 or more"
    if not 0 <= args.num_cpus < float("inf"):
        return f"--num-cpus {args.num_cpus:g}: expected 0 or more"
    if args.json and not Path(args.json).absolute().parent.is_dir():
        return f"--json {args.json}: its folder does not exist"
    return None


def try_recipe(recipe: Path, args: argparse.Namespace) -> int:
    """Print the samples (and write them whole to ``--json``); 0, or 2 for a recipe this cannot run
    (its one-line error, as validate prints it)."""
    from rayapp.recipe import RecipeError

    bad = flag_problem(args)
    if bad is not None:
        print(f"rayapp try: {bad}", file=sys.stderr)
        return 2
    try:
        found = asyncio.run(run_steps(recipe, args))
    except RecipeError as e:
        print(str(e), file=sys.stderr)
        return 2
    except TimeoutError:
        print(f"rayapp try: a step ran past --timeout {args.timeout:g}s", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode(found))
        print(f"\nwrote the steps' whole results to {args.json}")
    if args.eval and not found["evals"]:
        print("(--eval: the recipe has no eval datasets)")
    return 0


def add_parser(sub: Any, recipe_help: str) -> None:
    t = sub.add_parser("try", help="a recipe's steps in this process, without Ray: the samples a trainer "
                                   "would get (hf engines only)")
    t.add_argument("recipe", help=recipe_help)
    t.add_argument("--rollouts", type=int, default=1, help="rollout steps to run (default 1)")
    t.add_argument("--eval", action="store_true", help="an eval step after each rollout step")
    t.add_argument("--json", default=None, metavar="FILE", help="write the steps' whole results (every sample) here")
    t.add_argument("--num-gpus", type=int, default=4,
                   help="logical GPUs of the one node, when the recipe's pool reads the live cluster")
    t.add_argument("--num-cpus", type=float, default=8.0,
                   help="CPUs of that node, unless the recipe's pool.num_cpus says")
    t.add_argument("--timeout", type=float, default=STEP_TIMEOUT_S, help="seconds for each step")
