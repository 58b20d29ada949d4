"""Math answers checked by ``math-verify``, in a child process that a hang cannot outlive.

Guarantees:

- ``verify_math(response, label)`` is True exactly when math-verify finds the label's value in the
  response: the last ``\\boxed{}`` first, then LaTeX, then a plain expression, compared as sympy
  values (``\\frac{1}{2}`` equals ``0.5``, ``\\text{(B)}`` equals ``B``, ``(1, 2)`` equals ``(1,2)``).
  A bare label is read as if written in ``$...$``.
- The parse and the comparison run in a persistent child process (``MathVerifier``'s workers, started
  with ``subprocess``, never forked from a threaded parent). A call that has no answer within
  ``timeout_s`` kills that worker and returns False: an answer that cannot be checked in time earns
  no reward, like a wrong one, rather than aborting the sample. ``timeouts`` counts such calls. The
  next call starts a fresh worker. A worker that dies mid-request counts and scores the same way.
- It blocks only the calling thread (env verifiers run in the executor's thread or bundle), so no
  event loop waits on sympy; ``verify_math_async`` is the same call for a coroutine.
- No process outlives its owner: ``close()`` (and, for the process-wide default, exit) kills every
  worker; on Linux a worker also dies with its parent, whatever killed the parent.
- ``math-verify`` missing is one ``ModuleNotFoundError`` that names the package to install.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib.util
import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from rayapp.types import AgentResult, Sample

log = logging.getLogger(__name__)

_WORKER_MODULE = "rayapp.verify._math_worker"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding rayapp/
DEFAULT_TIMEOUT_S = 5.0
START_TIMEOUT_S = 60.0  # a fresh worker imports sympy: seconds on a loaded machine, not part of a call's timeout


def _plain_minus(text: str) -> str:
    # U+2212 (the typographic minus) is a minus sign to a reader; math-verify's grammar knows only "-".
    return text.replace("\u2212", "-")


class WorkerGone(RuntimeError):
    """The worker did not answer in time, or died: it has been killed."""


_spawn_requests: queue.SimpleQueue = queue.SimpleQueue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawner_loop() -> None:
    while True:
        argv, env, done = _spawn_requests.get()
        try:
            done.set_result(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0))
        except BaseException as e:
            done.set_exception(e)


def _spawn(argv: list[str], env: dict[str, str], timeout_s: float) -> subprocess.Popen:
    """Start a worker from one thread that lives as long as this process. Linux's parent-death signal
    fires when the creating *thread* exits, so a worker started from a short-lived caller thread
    (``asyncio.to_thread``'s) would be killed with that thread."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawner_loop, name="math-verify-spawner", daemon=True)
            _spawner.start()
    done: Future[subprocess.Popen] = Future()
    _spawn_requests.put((argv, env, done))
    return done.result(timeout=timeout_s)


class _Worker:
    """One child process and its pipes. Not thread-safe: the pool lends it to one caller at a time."""

    def __init__(self, start_timeout_s: float):
        env = dict(os.environ)
        # The child imports rayapp from where this file is, also where rayapp is a checkout on sys.path.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        self.proc: subprocess.Popen = _spawn([sys.executable, "-m", _WORKER_MODULE], env, start_timeout_s)
        self._pending = b""
        try:
            if self._read_line(start_timeout_s) != "ready":
                raise WorkerGone("the math-verify worker started but did not say ready")
        except BaseException:
            self.kill()
            raise

    def ask(self, response: str, label: str, timeout_s: float) -> bool:
        line = json.dumps({"response": response, "label": label}).encode() + b"\n"
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line)
        except (BrokenPipeError, OSError) as e:
            raise WorkerGone(f"the math-verify worker died: {e}") from e
        return self._read_line(timeout_s) == "1"

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise WorkerGone(f"no answer from the math-verify worker within {timeout_s}s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise WorkerGone(f"the math-verify worker exited (code {self.proc.poll()})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()  # reap it: no zombie
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class MathVerifier:
    """A pool of at most ``max_workers`` math-verify worker processes, started on first use and
    kept for later calls. Thread-safe; see the module docstring for the guarantees."""

    def __init__(self, max_workers: int = 2, start_timeout_s: float = START_TIMEOUT_S):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"MathVerifier: max_workers must be an int >= 1, got {max_workers!r}")
        if importlib.util.find_spec("math_verify") is None:
            raise ModuleNotFoundError("math rewards need the math-verify package: pip install math-verify",
                                      name="math_verify")
        self.start_timeout_s = start_timeout_s
        self.timeouts = 0  # calls that got no answer in time (or whose worker died): scored False
        self._slots = threading.BoundedSemaphore(max_workers)
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def verify(self, response: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
        if not (isinstance(timeout_s, int | float) and timeout_s > 0):
            raise ValueError(f"verify_math: timeout_s must be a number > 0, got {timeout_s!r}")
        if not response:
            return False
        response, label = _plain_minus(response), _plain_minus(str(label))
        with self._slots:  # at most max_workers calls in flight; the rest wait for a worker
            worker = self._checkout()
            try:
                ok = worker.ask(response, label, timeout_s)
            except WorkerGone as e:
                self._discard(worker)
                with self._lock:
                    self.timeouts += 1
                log.warning("math-verify scored a response 0: %s (label %r, response %.200r)", e, label, response)
                return False
            except BaseException:
                self._discard(worker)  # interrupted mid-request: its answer would be read by the next caller
                raise
            self._checkin(worker)
            return ok

    def _checkout(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self.start_timeout_s)
        with self._lock:
            self._busy.add(worker)
        return worker

    def _checkin(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.kill()

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (idle and busy)."""
        with self._lock:
            return [w.proc.pid for w in (*self._idle, *self._busy)]

    def close(self) -> None:
        """Kill every worker; a call in flight gets False (its worker is gone), later calls raise."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
        for worker in idle:
            worker.kill()
        for worker in busy:  # only signalled: the caller reading its pipe sees it gone and reaps it
            if worker.proc.poll() is None:
                worker.proc.kill()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """This process's shared MathVerifier, made on first use and closed at exit."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
            atexit.register(_default.close)
        return _default


def _forget_default_in_child() -> None:
    # A forked child must not talk to its parent's workers, nor wait on a spawner thread it lacks.
    global _default, _default_lock, _spawner, _spawner_lock, _spawn_requests
    _default, _default_lock = None, threading.Lock()
    _spawner, _spawner_lock, _spawn_requests = None, threading.Lock(), queue.SimpleQueue()


os.register_at_fork(after_in_child=_forget_default_in_child)


def verify_math(response_text: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether ``response_text`` states the answer ``label`` (math-verify, in the default worker pool).
    False on no answer, a wrong one, or no verdict within ``timeout_s`` seconds."""
    return default_verifier().verify(response_text, label, timeout_s)


async def verify_math_async(response_text: str, label: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """``verify_math`` from a coroutine: the wait happens in a worker thread, not on the event loop."""
    return await asyncio.to_thread(verify_math, response_text, label, timeout_s)


def verify(sample: Sample, result: AgentResult) -> dict[str, float]:
    """The env verifier: ``{"score": 1.0}`` when the response states the sample's label, else 0.0."""
    return {"score": 1.0 if verify_math(result.response or "", str(sample.label)) else 0.0}
