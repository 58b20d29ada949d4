"""A Ray head on 127.0.0.1 with logical GPUs, ``serve run`` of a recipe on it, and a clean stop:
what ``rayapp run`` and ``rayapp demo`` (and the tests that start a cluster) share."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

# The checkout (tests and the Makefile read recipes/ from it); in an installed package, site-packages.
ROOT = Path(__file__).resolve().parents[2]
LOCAL_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0",
             "MALLOC_ARENA_MAX": "2"}
# Why: for the knob reference.
LOCAL_ENV_WHY = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "Ray's; 0: no multi-node Ray on Windows or macOS (one machine only)",
    "RAY_AUTH_MODE": "Ray's; token: GCS, raylet, dashboard and Serve's gRPC between replicas refuse a caller "
                     "without the cluster's token. A head of rayapp's own gets a fresh one (RAY_AUTH_TOKEN_PATH, "
                     "a file only this user reads); see docs/security.md",
    "RAY_USAGE_STATS_ENABLED": "Ray's; 0: no usage statistics (the machine has no outside network)",
    "MALLOC_ARENA_MAX": "glibc's; 2: two malloc arenas per process. With one per thread the manager replica kept "
                        "freed memory in ~20 arenas and its RSS grew ~2.4 MB a step (0.36 MB with 2). Set it in "
                        "a cluster's environment too (not in a deployment's runtime_env: that replaces the "
                        "application's env_vars, the HTTP token among them)",
}
# Where Ray's processes and clients read the token from (Ray's names); an own head replaces them.
AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
# Set for `ray start` of a head of our own: every process of that cluster inherits it (raylet, GCS, workers,
# and the ones whose command line names no folder, as Ray's client server), so the stop finds them all.
CLUSTER_ENV = "RAYAPP_CLUSTER"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def auth_token() -> Iterator[Path]:
    """Ray's token authentication on, with a fresh token for a Ray of our own: the token file is in a
    new folder only this user can read, and this process's environment names it, so ``ray start``,
    ``ray.init``, ``serve run`` and the driver (which inherit it) all present it. Never ~/.ray: a
    demo or a test run does not replace the user's own token. The environment is restored and the
    token deleted when the block ends."""
    saved = {k: os.environ.get(k) for k in AUTH_ENV}
    folder = Path(tempfile.mkdtemp(prefix="rayapp-auth-"))  # mode 0700
    path = folder / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # 256 bits, as `ray get-auth-token --generate` makes
    os.environ.pop("RAY_AUTH_TOKEN", None)  # Ray reads it before the file
    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path)})
    _refresh_ray_auth()
    try:
        yield path
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(folder, ignore_errors=True)
        _refresh_ray_auth()


def process_auth_token() -> Path:
    """``auth_token`` for the rest of this process (a bench script, a test module starting its own
    Ray): call it before Ray starts; the token is deleted at exit."""
    block = auth_token()
    path = block.__enter__()
    atexit.register(block.__exit__, None, None, None)
    return path


def _refresh_ray_auth() -> None:
    """Ray, when this process imported it already, caches the mode and the token: read them again."""
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None:
        raylet.Config.initialize("")
        raylet.AuthenticationTokenLoader.instance().reset_cache()


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def start_head(num_gpus: int, num_cpus: int, temp_dir: Path, dashboard_port: int, out: IO[str] | None = None,
               echo: bool = False) -> str:
    """``ray start --head``; its output (Ray's banner and warnings) goes to ``out``, and to this process's
    stderr too when ``echo``; a failed start raises with its last line."""
    port = free_port()
    cmd = [_bin("ray"), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
           f"--num-gpus={num_gpus}", f"--num-cpus={num_cpus}", "--include-dashboard=true",
           "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", f"--temp-dir={temp_dir}",
           "--disable-usage-stats"]
    env = {**os.environ, CLUSTER_ENV: str(temp_dir)}
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          timeout=180, env=env)
    copy_lines(done.stdout.splitlines(keepends=True), out, echo)
    if done.returncode != 0:
        last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        where = f"; its output: {out.name}" if out is not None else ""
        raise RuntimeError(f"ray start exited with {done.returncode}: {last}{where}")
    return f"127.0.0.1:{port}"


def copy_lines(lines: Iterable[str], out: IO[str] | None, echo: bool) -> None:
    """Ray's and Serve's lines into the run's log, and onto this terminal's stderr when ``echo`` (``--verbose``)."""
    for line in lines:
        if out is not None:
            out.write(line)
            out.flush()  # the log is read while the run goes on (tail -f, a failed deployment's cause)
        if echo:
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # the terminal went away: the log still gets every line
                echo = False


def deploy_error(message: str) -> str:
    """The exception's own line in Serve's status messages of a failed application and its
    deployments (a traceback's last line: ``RecipeError: recipe "<args>": $.evaluators[0].agent:
    ...``); the messages' last line when they hold no traceback."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in message.splitlines()]
    lines = [line for line in lines if line]
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", line)]
    return (errors or lines or ["(no message)"])[-1]


# Prints the application's [status, messages, {deployment: status}, last deployed time] as one JSON line.
_STATUS_CODE = (
    "import json, ray, sys; from ray import serve; ray.init(address=sys.argv[1], logging_level='error', "
    "log_to_driver=False); s = serve.status().applications.get(sys.argv[2]); "
    "st = lambda x: str(getattr(x, 'value', x)); "
    "print(json.dumps([st(s.status), '\\n'.join([s.message, *(d.message for d in s.deployments.values())]), "
    "{n: st(d.status) for n, d in s.deployments.items()}, s.last_deployed_time_s] if s else "
    "['MISSING', '', {}, None]))")


def app_status(address: str, app: str) -> tuple[str, str, dict[str, str], float | None]:
    """Serve's status of ``app`` on the cluster at ``address``: (status, messages, deployments' states,
    when it was last deployed); ("", "", {}, None) when the answer could not be read, ("MISSING", ...)
    when there is no such application."""
    out = subprocess.run([sys.executable, "-c", _STATUS_CODE, address, app], capture_output=True, text=True,
                         timeout=120).stdout.strip()
    try:
        status, message, deployments, deployed_at = json.loads(out.splitlines()[-1]) if out else ("", "", {}, None)
    except ValueError:  # not the line printed above: the caller asks again
        return "", "", {}, None
    return status, message, deployments, deployed_at


def wait_for_app(address: str, app: str, timeout_s: float, serve_proc: subprocess.Popen, log: Path,
                 deployed_before: float | None = None) -> None:
    """Until ``app`` is RUNNING (its deployments' states said on stdout as they change: a deploy takes
    about a minute on 2 cores), or one error naming the cause and the log. ``deployed_before``: when
    the app already running there was deployed (``app_status``), so that only a later deployment, the
    one ``serve_proc`` submits, counts: the old one's RUNNING is not the new one's."""
    start = time.monotonic()
    deadline, said = start + timeout_s, None
    while time.monotonic() < deadline:
        if serve_proc.poll() is not None:
            raise RuntimeError(f"serve run exited with {serve_proc.returncode}; see {log}")
        status, message, deployments, deployed_at = app_status(address, app)
        if deployed_before is not None and (deployed_at is None or deployed_at <= deployed_before):
            state = f"{app} {status.lower() or 'unknown'} (the deployment before this one): waiting for the new one"
        elif status.endswith("RUNNING"):
            return
        elif status.endswith(("DEPLOY_FAILED", "UNHEALTHY")):
            raise RuntimeError(f"application {app} is {status}: {deploy_error(message)}\n(full log: {log})")
        else:
            state = ", ".join(f"{name} {value.lower()}" for name, value in sorted(deployments.items()))
        if state and state != said:
            print(f"  serve: {state} ({time.monotonic() - start:.0f}s)", flush=True)
            said = state
        time.sleep(2)
    raise TimeoutError(f"application {app} not RUNNING within {timeout_s}s; see {log}")


def ray_processes(temp_dir: Path) -> list[int]:
    """The processes of the Ray cluster under ``temp_dir``: each that inherited ``CLUSTER_ENV`` naming it
    from ``start_head``, whose command line names the folder (what a head started otherwise leaves), or
    that holds a file under it open (Ray's processes write their logs there), and every descendant of
    these. Ray rewrites process titles (``ray::DashboardAgent``, ``ray-dashboard-NodeHead-0 (...)``),
    and a long title overwrites the memory /proc reads a process's environment from: no one sign finds
    them all."""
    # -ww: full command lines whatever COLUMNS says (pytest sets it; ps would cut at that width)
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    # the folder itself, not a longer name that starts with it (/tmp/x-12 is not /tmp/x-123)
    mine = re.compile(re.escape(str(temp_dir)) + r"(?=/|\s|$)")
    children: dict[int, list[int]] = {}
    pids = set()
    for line in out.splitlines():
        pid, ppid, *args = line.split(None, 2)
        children.setdefault(int(ppid), []).append(int(pid))
        if args and mine.search(args[0]):
            pids.add(int(pid))
    pids |= _inherited(f"{CLUSTER_ENV}={temp_dir}".encode()) | _holding_open(str(temp_dir))
    pids.discard(os.getpid())  # a driver of the cluster (its logs are in the folder): not it, nor its children
    todo = list(pids)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in pids:
                pids.add(child)
                todo.append(child)
    return sorted(pids)


def _inherited(entry: bytes) -> set[int]:
    """The processes whose environment holds ``entry`` exactly (Linux's /proc; none elsewhere)."""
    found = set()
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if entry in (d / "environ").read_bytes().split(b"\0"):
                found.add(int(d.name))
    return found


def _holding_open(folder: str) -> set[int]:
    """The processes with a file under ``folder`` open (Linux's /proc; none elsewhere)."""
    found = set()
    for d in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            for fd in os.scandir(d / "fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target == folder or target.startswith(folder + "/"):
                        found.add(int(d.name))
                        break
    return found


def stop_cluster(temp_dir: Path, grace_s: float = 15.0) -> list[int]:
    """Stop this demo's cluster only (``ray stop`` would stop every Ray on the machine): SIGTERM, then
    SIGKILL to what is left after ``grace_s`` (an orphaned ``ray::DashboardAgent`` ignores SIGTERM).
    Every process once found stays a target (a child of the raylet, orphaned when the raylet ends, is
    no longer found by its parent), known by its pid and start time, so a pid reused meanwhile is
    left alone. Returns the cluster's processes still alive."""
    targets: dict[int, str] = {}

    def look() -> set[int]:
        for pid in ray_processes(temp_dir):
            targets.setdefault(pid, _started(pid))
        return {pid for pid, started in targets.items() if started and _started(pid) == started}

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in sorted(look()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while look() and time.monotonic() < deadline:
            time.sleep(0.5)
    return sorted(look())


def _started(pid: int) -> str:
    """When process ``pid`` started (its start time in /proc), or "" when it has ended (a zombie: ended,
    not yet reaped) or cannot be read; where there is no /proc, "ps" while it exists."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return ""
        except PermissionError:
            pass
        return "ps"
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return ""
    return "" if fields[0] in ("Z", "X") else fields[19]  # state, starttime (the stat's 22nd field)


@contextlib.contextmanager
def local_app(recipe: str | Path, temp_dir: Path, log: Path, *, num_gpus: int = 4, num_cpus: int = 8,
              dashboard_port: int | None = None, timeout_s: float = 900.0, cwd: str | Path = ROOT,
              address: str | None = None, verbose: bool = False) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Ray head on 127.0.0.1 with logical GPUs and Ray's token authentication (a fresh token:
    ``auth_token``), and ``serve run recipe`` on it, yielded as (address, serve process) once the app
    is RUNNING; both are stopped when the block ends. ``log`` gets ``ray start``'s and ``serve run``'s
    output (Ray's, Serve's controller's and every replica's lines); ``verbose`` copies them to stderr too.
    Given ``address``, no head is started: the app runs on that cluster and only it is stopped.
    ``serve run`` starts in ``cwd``, against which the recipe's relative layout path resolves."""
    proc, own_head, copier = None, address is None, None
    with contextlib.ExitStack() as stack:
        if own_head:  # a head of our own: a fresh token; on the user's cluster, the user's own token
            stack.enter_context(auth_token())
        out = stack.enter_context(open(log, "w"))
        try:
            if own_head:
                address = start_head(num_gpus, num_cpus, temp_dir, dashboard_port or free_port(), out, verbose)
            # On a cluster of the user's, an app of that name may be running already: only a later deployment counts.
            before = None if own_head else app_status(address, "rayapp")[3]
            serve_cmd = with_default_sigint([_bin("serve"), "run", f"--address={address}", str(recipe)])
            if verbose:  # through a pipe, copied line by line to the log and the terminal
                # errors="replace": a line that is not UTF-8 must not stop the copy (serve run would block)
                proc = subprocess.Popen(serve_cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        errors="replace", cwd=cwd, start_new_session=True)
                copier = threading.Thread(target=copy_lines, args=(proc.stdout, out, True), daemon=True)
                copier.start()
            else:
                proc = subprocess.Popen(serve_cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                        start_new_session=True)
            wait_for_app(address, "rayapp", timeout_s, proc, log, before)
            yield address, proc
        finally:
            _stop_serve_run(proc)
            if copier is not None:
                copier.join(timeout=30)  # serve run has exited: its pipe ends
            if not own_head and proc is not None:  # the user's cluster goes on: our application leaves it
                delete_app(address, "rayapp")
            if own_head:
                left = stop_cluster(temp_dir)
                print("shut down: " + ("no Ray process left" if not left else
                                       f"{len(left)} Ray processes left: {left}"))


# A process started in the background by a shell without job control ignores SIGINT, and its children inherit
# that: `serve run` would then ignore the Ctrl-C that takes its clean shutdown path. This exec puts it back.
_DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                   "os.execv(sys.argv[1], sys.argv[1:])")


def with_default_sigint(argv: list[str]) -> list[str]:
    """``argv`` run with SIGINT at its default disposition, whatever this process inherited."""
    return [sys.executable, "-c", _DEFAULT_SIGINT, *argv]


def delete_app(address: str, app: str) -> None:
    """Delete ``app`` from the cluster at ``address`` and wait until it is gone. ``serve run`` leaves its
    application running when stopped by SIGTERM (Ray's driver turns it into an exit that skips its clean-up),
    and its Ctrl-C path would shut down every application of the cluster's Serve."""
    code = ("import ray, sys; from ray import serve; ray.init(address=sys.argv[1], logging_level='error', "
            "log_to_driver=False); s = serve.status(); "
            "sys.argv[2] in s.applications and serve.delete(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, address, app], capture_output=True, timeout=180)


def _stop_serve_run(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)  # on an own head the cluster stops next; elsewhere delete_app follows
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


