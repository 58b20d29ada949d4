"""`rayapp validate <recipe>`: parse and check a recipe offline (no Ray), print OK or the error.

`rayapp demo`: the embedded default end to end, as a user would run it by hand.

1. start a local Ray head on 127.0.0.1 with logical GPUs (and the dashboard);
2. `serve run recipes/local/rollout.yaml` (the hf engine, the placement pool, the manager);
3. run the training driver for one rollout and one eval through the manager's handle;
4. shut everything down and check that no Ray process is left.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# Why: for the knob reference. Never set the first two on a real cluster.
LOCAL_ENV_WHY = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "Ray's; 0 keeps GCS, raylet, dashboard and Serve on 127.0.0.1 "
                                         "(one machine only)",
    "RAY_AUTH_MODE": "Ray's; disabled turns token auth off for the local dashboard API (one machine only)",
    "RAY_USAGE_STATS_ENABLED": "Ray's; 0: no usage statistics (the machine has no outside network)",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def start_head(num_gpus: int, num_cpus: int, temp_dir: Path, dashboard_port: int) -> str:
    port = free_port()
    cmd = [_bin("ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
           f"--num-gpus={num_gpus}", f"--num-cpus={num_cpus}", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=180)
    return f"127.0.0.1:{port}"


def wait_for_app(address: str, app: str, timeout_s: float, serve_proc: subprocess.Popen, log: Path) -> None:
    code = ("import ray, sys; from ray import serve; ray.init(address=sys.argv[1], logging_level='error', "
            "log_to_driver=False); s = serve.status().applications.get(sys.argv[2]); "
            "print(s.status if s else 'MISSING')")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if serve_proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {serve_proc.returncode}; see {log}")
        out = subprocess.run([sys.executable, "-c", code, address, app], capture_output=True, text=True,
                             timeout=120).stdout.strip()
        if out.endswith("RUNNING"):
            return
        if out.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            raise RuntimeError(f"application {app} is {out}; see {log}")
        time.sleep(2)
    raise TimeoutError(f"application {app} not RUNNING within {timeout_s}s; see {log}")


def ray_processes(temp_dir: Path) -> list[int]:
    """The processes of the Ray cluster under ``temp_dir`` (every one names its session folder)."""
    # -ww: full command lines whatever COLUMNS says (pytest sets it; ps would cut at that width)
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    # the folder itself, not a longer name that starts with it (/tmp/x-12 is not /tmp/x-123)
    mine = re.compile(re.escape(str(temp_dir)) + r"(?=/|\s|$)")
    pids = [int(line.split(None, 1)[0]) for line in out.splitlines() if mine.search(line)]
    return [p for p in pids if p != os.getpid()]


def stop_cluster(temp_dir: Path, grace_s: float = 15.0) -> list[int]:
    """Stop this demo's cluster only (``ray stop`` would stop every Ray on the machine)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in ray_processes(temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while ray_processes(temp_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
    return ray_processes(temp_dir)


@contextlib.contextmanager
def local_app(recipe: str | Path, temp_dir: Path, log: Path, *, num_gpus: int = 4, num_cpus: int = 8,
              dashboard_port: int | None = None, timeout_s: float = 900.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Ray head on 127.0.0.1 with logical GPUs and ``serve run recipe`` on it (output in ``log``),
    yielded as (address, serve process) once the app is RUNNING; both are stopped when the block ends."""
    proc = None
    try:
        address = start_head(num_gpus, num_cpus, temp_dir, dashboard_port or free_port())
        with open(log, "w") as out:
            proc = subprocess.Popen([_bin("serve"), "run", f"--address={address}", str(recipe)], stdout=out,
                                    stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        wait_for_app(address, "rayapp", timeout_s, proc, log)
        yield address, proc
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        left = stop_cluster(temp_dir)
        print("shut down: " + ("no Ray process left" if not left else f"{len(left)} Ray processes left: {left}"))


def demo(args: argparse.Namespace) -> int:
    if validate(args) != 0:  # a broken recipe stops here, before a cluster starts (serve run would wait)
        return 2
    os.environ.update(LOCAL_ENV)
    from rayapp.inference.tiny_model import ensure_tiny_model

    t0 = time.monotonic()
    print(f"tiny model ready at {ensure_tiny_model()} ({time.monotonic() - t0:.1f}s)", flush=True)
    temp_dir = Path(args.temp_dir or f"/tmp/rayapp-demo-{os.getpid()}")
    dashboard_port = free_port()
    serve_log = temp_dir.parent / f"{temp_dir.name}-serve.log"
    t1 = time.monotonic()
    with local_app(args.recipe, temp_dir, serve_log, num_gpus=args.num_gpus, num_cpus=args.num_cpus,
                   dashboard_port=dashboard_port, timeout_s=args.timeout) as (address, _):
        print(f"ray head at {address} with {args.num_gpus} logical GPUs; dashboard http://127.0.0.1:{dashboard_port}"
              f" (placement groups: /#/cluster, API /api/v0/placement_groups)", flush=True)
        print(f"serve app running ({time.monotonic() - t1:.1f}s after ray start); log: {serve_log}", flush=True)
        t2 = time.monotonic()
        subprocess.run([sys.executable, str(ROOT / "recipes" / "driver.py"), f"--address={address}",
                        "--rollouts", str(args.rollouts), "--eval"], check=True, timeout=args.timeout)
        print(f"driver done in {time.monotonic() - t2:.1f}s", flush=True)
    return 0


def validate(args: argparse.Namespace) -> int:
    """The same door the app builder uses (``load_recipe``); the layout file, if any, is read too."""
    from rayapp.recipe import RecipeError, load_recipe

    try:
        load_recipe(args.recipe)
    except RecipeError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"{args.recipe}: OK")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayapp", description="rayapp command line")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help=__doc__.splitlines()[0])
    d.add_argument("--recipe", default="recipes/local/rollout.yaml",
                   help="the Serve config to run; a relative path not found here is taken from the checkout")
    d.add_argument("--num-gpus", type=int, default=4, help="logical GPUs of the local Ray head")
    d.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray head")
    d.add_argument("--rollouts", type=int, default=1, help="iterations the driver runs: rollout k, then eval k")
    d.add_argument("--timeout", type=float, default=900.0, help="seconds for the app to start, and for each step")
    d.add_argument("--temp-dir", default=None, help="Ray's session folder (default: /tmp/rayapp-demo-<pid>)")
    v = sub.add_parser("validate", help=__doc__.splitlines()[0].split(": ", 1)[1])
    v.add_argument("recipe", help="a Serve config whose rayapp application's args are the recipe, or bare args")
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.cmd == "validate":
        sys.exit(validate(args))
    recipe = Path(args.recipe)
    # serve run starts in the checkout: hand it an absolute path
    args.recipe = str(recipe.resolve() if recipe.exists() or recipe.is_absolute() else ROOT / recipe)
    sys.exit(demo(args))


if __name__ == "__main__":
    main()
