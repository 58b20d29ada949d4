"""A recipe's checks in a child process, watched: ``rayapp validate`` calls the recipe's plug-in code
(imports, ``rows(cfg)``, agent factories), and plug-in code may block, loop forever, or end the
process without a word (``os._exit``, a signal), which no thread or ``except`` can catch. So the
checks run in a forked child that reports each call into a user's code as it starts and ends
(``rayapp.envs.watch``); the parent gives each such call ``call_timeout_s`` (plus a grace, so a
call's own bound speaks first) and, when the child hangs in one or dies, says which recipe field
and which call it was, whether it was busy on a CPU (slow, or endless) or idle (blocked), and kills
what is left.

The child's stdout and stderr go to /dev/null (validate prints one line per problem, no plug-in's
chatter); it never returns into its parent's stack: it ends with ``os._exit``. Where ``os.fork``
does not exist the checks run in this process, unwatched.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Callable
from typing import Any

from rayapp.envs import watch

# A watched call and its outcome: (JSON path in the recipe's args, what ran, what became of it).
Stuck = tuple[str, str, str]


def run_watched(fn: Callable[[], Any], call_timeout_s: float, grace_s: float = 0.0) -> tuple[Any, Stuck | None]:
    """``(fn(), None)`` (its result JSON-encodable), or ``(None, (field, what, outcome))`` when a call
    into plug-in code ran past ``call_timeout_s`` (and ``grace_s``) or the child ended before answering."""
    if not hasattr(os, "fork"):
        return fn(), None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.setpgid(0, 0)  # its own process group: whatever a plug-in started goes with it
        os.close(read_end)
        _child(fn, write_end)
    with contextlib.suppress(OSError):  # it set its own group already, or has ended: the kill below finds it
        os.setpgid(pid, pid)
    os.close(write_end)
    try:
        return _watch(pid, read_end, call_timeout_s, grace_s)
    finally:
        os.close(read_end)
        _reap(pid)


def _child(fn: Callable[[], Any], out: int) -> None:
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)

        def send(message: dict[str, Any]) -> None:
            data = (json.dumps(message) + "\n").encode()
            while data:
                data = data[os.write(out, data):]

        watch.WATCHER = lambda at, what: send({"at": at, "what": what})
        result = fn()
        watch.WATCHER = None
        send({"result": result})
    except BaseException as e:  # anything left: said by the parent, as of the call it came from
        code = 70
        try:
            said = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"raised {type(e).__name__}: {e}"
            send({"error": said})
        except BaseException:  # the pipe is gone: the parent says the child ended
            pass
    finally:
        os._exit(code)


def _watch(pid: int, fd: int, call_timeout_s: float, grace_s: float) -> tuple[Any, Stuck | None]:
    buf, now = b"", ("$", "checking the recipe")
    deadline: float | None = None
    cpu_at_start: float | None = None
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            cpu = _cpu_s(pid)
            os.kill(pid, signal.SIGKILL)
            return None, (*now, _still_running(call_timeout_s + grace_s, cpu, cpu_at_start))
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:  # it closed its end of the pipe: it is exiting
            _, status = os.waitpid(pid, 0)  # (its group id stays taken while any process of it lives)
            return None, (*now, _ended(status))
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "result" in message:
                return message["result"], None
            if "error" in message:
                return None, (*now, message["error"])
            if message["at"] is None:
                now, deadline = ("$", "checking the recipe"), None
            else:
                now, deadline = (message["at"], message["what"]), time.monotonic() + call_timeout_s + grace_s
                cpu_at_start = _cpu_s(pid)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (all its threads), from /proc; None where that cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return None


def _still_running(seconds: float, cpu: float | None, cpu_at_start: float | None) -> str:
    """A call still running after ``seconds``: busy on a CPU most of that time (slow, or endless) or not (it
    blocks or waits), where /proc tells; and how to allow more time."""
    from rayapp.envs.plugin_import import TIMEOUT_ENV

    more = f"if it is only slow, allow more with {TIMEOUT_ENV}=<seconds> (rayapp validate --plugin-timeout)"
    if cpu is None or cpu_at_start is None:
        return f"still running after {seconds:g} s (does it block, or never end? {more})"
    used = cpu - cpu_at_start
    if used >= 0.5 * seconds:
        return f"still running after {seconds:g} s, busy ({used:.0f} s of CPU): slow, or never ends; {more}"
    return f"still running after {seconds:g} s, mostly idle ({used:.1f} s of CPU): does it block or wait? {more}"


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"ended the process by signal {signal.Signals(os.WTERMSIG(status)).name}, without a word"
    return f"ended the process (exit status {os.WEXITSTATUS(status)}) without a word (os._exit?)"


def _reap(pid: int) -> None:
    """The child's process group killed and the child waited for, unless ``_watch`` has waited already."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
