"""The manager replica's memory over a long run of the local recipe (issue 19 point 8).

    python bench/replica_memory.py                   # 200 steps: a rollout each, an eval and a weight update every 10
    python bench/replica_memory.py --steps 40 --every 5
    python bench/replica_memory.py --analyse run.csv # the table and the verdict again, from a run's --csv

The local recipe's Serve app starts as ``rayapp run`` starts it (``rayapp.cli.local_app``: a Ray head on
127.0.0.1 with logical GPUs and Ray's token authentication, ``LOCAL_ENV``, ``serve run``); the driver
calls the manager through its handle: rollout ``i`` every step, eval ``i`` and a weight update (the
tiny model's own folder, as the next version) every ``--every`` steps. After each step it reads, from
/proc, the RSS (``VmRSS``) and the anonymous memory (``smaps_rollup``'s ``Anonymous``: the heap, glibc's
arenas and Python's, what the process allocated itself, free or not) of the manager replica and of the
pool replica.

Verdict: the least-squares slope (MB/step) of each series over the first quarter of the steps (1-50
of 200) and over the second half (100-200). PLATEAU when every late slope is at most
``--limit`` MB/step (0.02: 2 MB over 100 steps); GROWTH otherwise, naming the series. A run stopped
early (``--max-minutes``) is judged over the steps it reached, saying so.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from rayapp.cli.local_cluster import LOCAL_ENV, ROOT, free_port, local_app, ray_processes

# Serve's proxy start check (5 s) fails on a loaded machine (2 shared cores), and `serve run` exits with it
SLOW_MACHINE_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
REPLICAS = {"manager": "SchedulerRolloutManager", "pool": "PlacementPoolService"}
SERIES = [f"{who}_{what}" for who in REPLICAS for what in ("rss", "anon")]
LIMIT = 0.02  # MB/step over the late window: 2 MB per 100 steps
STEP_TIMEOUT_S = 900.0


def read_memory(pid: int) -> tuple[float, float]:
    """(RSS, anonymous) of ``pid`` in MB, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()

    def kb(text: str, key: str) -> float:
        for line in text.splitlines():
            if line.startswith(key + ":"):
                return float(line.split()[1])
        raise ValueError(f"/proc/{pid}: no {key} line")

    return kb(status, "VmRSS") / 1024, kb(rollup, "Anonymous") / 1024


def replica_pids(temp_dir: Path) -> dict[str, int]:
    """The live replica process of each deployment in ``REPLICAS`` (its title names the deployment)."""
    found = {}
    for pid in ray_processes(temp_dir):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for who, deployment in REPLICAS.items():
            if title.startswith(f"ray::ServeReplica:rayapp:{deployment}"):
                found[who] = pid
    missing = sorted(set(REPLICAS) - set(found))
    if missing:
        raise RuntimeError(f"no replica process for {missing} among the cluster's processes under {temp_dir}")
    return found


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (step, value)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


def windows(planned: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The early and the late window of a run of ``planned`` steps: 1..N/4 and N/2..N."""
    return (1, max(2, planned // 4)), (max(2, planned // 2), planned)


def verdict(rows: list[dict[str, float]], planned: int, limit: float) -> list[str]:
    """The slopes and the verdict, as lines."""
    reached = int(rows[-1]["step"]) if rows else 0
    early, late = windows(planned)
    late = (late[0], min(late[1], reached)) if reached >= late[0] else late
    lines = [f"{'series':<14} {f'slope {early[0]}-{early[1]}':>14} {f'slope {late[0]}-{late[1]}':>14}  (MB/step)"]
    growing = []
    for name in SERIES:
        pts = {w: [(int(r["step"]), r[name]) for r in rows if w[0] <= r["step"] <= w[1]] for w in (early, late)}
        first = f"{slope(pts[early]):14.4f}" if len(pts[early]) >= 2 else f"{'n/a':>14}"
        if len(pts[late]) >= 2:
            s = slope(pts[late])
            growing += [f"{name} {s:+.4f}"] if s > limit else []
            lines.append(f"{name:<14} {first} {s:14.4f}")
        else:
            lines.append(f"{name:<14} {first} {'n/a':>14}")
    short = reached < planned
    if reached < late[0] + 10:  # too few late steps to tell a slope from the noise
        lines.append(f"verdict: UNDECIDED ({reached} of {planned} steps; the late window starts at {late[0]})")
    else:
        said = "GROWTH (" + ", ".join(growing) + ")" if growing else "PLATEAU"
        lines.append(f"verdict: {said}: every late slope at most {limit} MB/step is a plateau"
                     + (f"; judged over {reached} of {planned} steps" if short else ""))
    return lines


def table(rows: list[dict[str, float]]) -> list[str]:
    head = f"{'step':>5} {'kind':<8} {'s':>6} " + " ".join(f"{n:>13}" for n in SERIES)
    return [head] + [f"{int(r['step']):>5} {r['kind']:<8} {r['seconds']:6.1f} "
                     + " ".join(f"{r[n]:13.1f}" for n in SERIES) for r in rows]


def recipe_file(tmp: Path, batch: int | None) -> Path:
    """The local recipe with a free HTTP port and eval details under ``tmp``."""
    cfg = yaml.safe_load((ROOT / "recipes" / "local" / "rollout.yaml").read_text())
    cfg["http_options"]["port"] = free_port()
    args = cfg["applications"][0]["args"]
    args["scheduler"]["save_eval_details"] = str(tmp / "details")
    if batch is not None:
        args["scheduler"]["rollout_batch_size"] = batch
    path = tmp / "rollout.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run(args: argparse.Namespace) -> list[dict[str, float]]:
    # before Ray's import: it reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER then (0: 127.0.0.1 stays 127.0.0.1)
    os.environ.update(LOCAL_ENV)
    for k, v in SLOW_MACHINE_ENV.items():
        os.environ.setdefault(k, v)
    import ray
    from ray import serve

    from rayapp.envs.tiny_model_recipe import TRAINING
    from rayapp.inference.tiny_model import ensure_tiny_model

    weights = str(ensure_tiny_model(training=TRAINING))  # the served model's folder: inside its weight roots
    tmp = Path(tempfile.mkdtemp(prefix="rayapp-mem-"))
    temp_dir = Path(f"/tmp/rayapp-mem-{os.getpid()}")
    rows: list[dict[str, float]] = []
    out = open(args.csv, "w", newline="") if args.csv else None  # noqa: SIM115 (closed below)
    writer = csv.DictWriter(out, ["step", "kind", "seconds", *SERIES]) if out else None
    if writer:
        writer.writeheader()
    deadline = time.monotonic() + args.max_minutes * 60
    print(f"serve log: {tmp / 'serve.log'}", flush=True)
    try:
        with local_app(recipe_file(tmp, args.batch), temp_dir, tmp / "serve.log", timeout_s=900) as (address, _):
            ray.init(address=address, namespace="rayapp-mem", logging_level="error", log_to_driver=False)
            try:
                handle = serve.get_app_handle("rayapp")
                print(table([])[0], flush=True)
                for step in range(1, args.steps + 1):
                    if time.monotonic() > deadline:
                        print(f"stopped at --max-minutes {args.max_minutes}", flush=True)
                        break
                    t0 = time.monotonic()
                    handle.generate.remote(step).result(timeout_s=STEP_TIMEOUT_S)
                    kind = "rollout"
                    if step % args.every == 0:
                        handle.evaluate.remote(step).result(timeout_s=STEP_TIMEOUT_S)
                        handle.update_weights_from_disk.remote("student", weights).result(timeout_s=STEP_TIMEOUT_S)
                        kind = "+eval+w"
                    row: dict = {"step": step, "kind": kind, "seconds": time.monotonic() - t0}
                    for who, pid in replica_pids(temp_dir).items():
                        row[f"{who}_rss"], row[f"{who}_anon"] = read_memory(pid)
                    rows.append(row)
                    print(table([row])[1], flush=True)
                    if writer:
                        writer.writerow(row)
                        out.flush()
            finally:
                ray.shutdown()
    finally:
        if out:
            out.close()
    return rows


def load(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: (v if k == "kind" else float(v)) for k, v in r.items()} for r in csv.DictReader(f)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10, help="an eval and a weight update every this many steps")
    ap.add_argument("--batch", type=int, default=None, help="rollout_batch_size (default: the recipe's)")
    ap.add_argument("--limit", type=float, default=LIMIT, help="MB/step a late slope may reach and be a plateau")
    ap.add_argument("--max-minutes", type=float, default=float("inf"), help="stop early and judge what ran")
    ap.add_argument("--csv", help="write each step's row here as it comes")
    ap.add_argument("--analyse", metavar="CSV", help="no run: the table and the verdict of a run's --csv")
    args = ap.parse_args()
    if args.steps < 1 or args.every < 1:
        ap.error("--steps and --every must be at least 1")
    if args.analyse:
        rows = load(args.analyse)
        print("\n".join(table(rows)))
    else:
        rows = run(args)
    if not rows:
        sys.exit("no step completed")
    print("\n".join(verdict(rows, args.steps, args.limit)))


if __name__ == "__main__":
    main()
