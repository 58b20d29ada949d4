"""Trampoline: turn a fresh process into a sandboxed command, then exec it.

``python -I -S _launch.py SPEC_JSON STATUS_FD -- ARGV...`` (run by ``LocalProcessSandbox``). It
exists because ``preexec_fn`` is unsafe in a multi-threaded Ray worker; a fresh interpreter that
imports only the standard library can set up namespaces, root, rlimits and identity before any
privilege is dropped, without trusting the project's path. Invariant: each step runs while it still
can (rlimits before dropping privileges, ``no_new_privs`` before exec); a failure before exec is
written to STATUS_FD with exit 125 (a sandbox fault), a successful exec closes it. Modes
``{"probe": true}`` and ``{"kill_uid": N}`` report what the kernel allows and kill a uid's
processes. The order and the reasons: docs/reliability.md, "The local sandbox's view of the machine".
"""

# Everything is imported up front: after the uid switch the interpreter's own standard library may
# be unreadable (a pyenv under /root), and after pivot_root it is gone, so a lazy import would fail.
import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import warnings  # noqa: F401  os.execvp imports it lazily

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script's own folder out
from _newroot import LIBC, build_root

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PROBE_STAGE = "/tmp"  # the probe's throwaway root: covered only inside its own mount namespace


def _unshare(flags):
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    if LIBC.unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _loopback_up():
    # A new network namespace has only a loopback device, and it is down. Bringing it up gives
    # commands a private 127.0.0.1 (a test server inside the sandbox works) that cannot reach the
    # host's own loopback. Best effort: a down loopback is still isolated.
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, siocgifflags, ifreq))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def enter_namespaces(flags):
    if os.geteuid() == 0:
        _unshare(flags)
    else:
        # Unprivileged: a user namespace grants CAP_SYS_ADMIN over the new namespaces. Map our
        # own uid/gid to themselves so files keep their owner.
        uid, gid = os.getuid(), os.getgid()
        _unshare(CLONE_NEWUSER | flags)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")


def isolate_network():
    enter_namespaces(CLONE_NEWNET)
    with contextlib.suppress(OSError):
        _loopback_up()


def switch_user(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def no_new_privs():
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError("prctl(PR_SET_NO_NEW_PRIVS) failed")


def set_limits(limits):
    for name, value in limits:
        kind = getattr(resource, name)
        soft, hard = (value, value) if isinstance(value, int) else value
        _, cur_hard = resource.getrlimit(kind)
        if os.geteuid() != 0 and cur_hard != resource.RLIM_INFINITY:
            # Unprivileged, a hard limit can only be lowered: clamp rather than fail.
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(kind, (soft, hard))


def _error(e):
    return f"{type(e).__name__}: {e}"


def _probe_root(report):
    stage = {"stage": PROBE_STAGE, "shm_bytes": 1 << 20}
    try:
        try:
            build_root(stage, own_proc=report["pid"] is None)
        except OSError as e:
            if report["pid"] is not None:
                raise
            report["pid"] = _error(e)  # a kernel may refuse a proc mount (a masked /proc): try without
            build_root(stage, own_proc=False)
    except OSError as e:
        report["mount"] = _error(e)


def probe(spec, status_fd):
    """Try each step as a command would get it; the report (step -> error or None) goes to STATUS_FD."""
    report = {"net": None, "mount": None, "pid": None, "user": None}
    try:
        isolate_network()
    except OSError as e:
        report["net"] = _error(e)
    # After the network step's user namespace (unprivileged) or as root: what a command gets.
    enter = _unshare if report["net"] is None else enter_namespaces
    try:
        enter(CLONE_NEWNS | CLONE_NEWPID)
    except OSError as e:
        report["pid"] = _error(e)
        try:
            enter(CLONE_NEWNS)
        except OSError as e2:
            report["mount"] = _error(e2)
    if report["pid"] is None:
        child = os.fork()  # the new PID namespace's first process
        if child:
            return os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if report["mount"] is None:
        _probe_root(report)
    if report["mount"] is not None and report["pid"] is None:
        report["pid"] = f"needs the sandbox's own root: {report['mount']}"
    if spec.get("uid") is not None:
        try:
            switch_user(spec["uid"], spec["gid"])
        except OSError as e:
            report["user"] = _error(e)
    os.write(status_fd, json.dumps(report).encode())
    return 0


def kill_uid(uid):
    switch_user(uid, uid)
    for _ in range(100):
        try:
            os.kill(-1, signal.SIGKILL)  # every process of this uid except ourselves
        except ProcessLookupError:
            return  # none left
        except PermissionError:
            return


def relay(child, relay_r):
    """Outside the PID namespace: wait for its init, then end as the command ended (its exit code,
    or killed by its signal), which init wrote to ``relay_r``; nothing there: init itself failed."""
    status = os.waitpid(child, 0)[1]
    with contextlib.suppress(OSError, ValueError):
        status = int(os.read(relay_r, 32) or status)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig  # not reached for a signal that ends a process
    return os.waitstatus_to_exitcode(status)


def init(command, relay_w):
    """PID 1 of the namespace: reap every orphan until ``command`` is done, pass its status on."""
    while True:
        pid, status = os.wait()
        if pid == command:
            os.write(relay_w, str(status).encode())
            return 0


def enter_sandbox(spec, steps):
    """Steps 1-2 of the module's docstring, naming each in ``steps``. None in the process that goes
    on to run the command; in the relay and in init, their exit code once the command is done."""
    root, own_pids = spec.get("root"), bool(spec.get("isolate_pids"))
    flags = (CLONE_NEWNET if spec.get("isolate_network") else 0) | (CLONE_NEWNS if root else 0)
    flags |= CLONE_NEWPID if own_pids else 0
    if flags:
        steps.append("enter new namespaces")
        enter_namespaces(flags)
    if flags & CLONE_NEWNET:
        with contextlib.suppress(OSError):
            _loopback_up()
    if own_pids:
        steps.append("start the PID namespace")
        relay_r, relay_w = os.pipe()
        child = os.fork()
        if child:
            os.close(relay_w)
            return relay(child, relay_r)
        os.close(relay_r)
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the relay killed alone: init goes too
    if root:
        steps.append("build the sandbox's root")
        build_root(root, own_proc=own_pids)
    if own_pids:
        steps.append("start the command")
        command = os.fork()
        if command:
            return init(command, relay_w)
        os.close(relay_w)
    return None


def main():
    spec, status_fd, argv = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[4:]
    if spec.get("probe"):
        return probe(spec, status_fd)
    if spec.get("kill_uid") is not None:
        kill_uid(spec["kill_uid"])
        return 0
    steps = ["start"]
    try:
        code = enter_sandbox(spec, steps)
        if code is not None:
            # The relay or init, done. os._exit: an interpreter's orderly shutdown costs ~20 ms each,
            # and nothing here is buffered (everything went through os.write).
            os._exit(code)
        steps.append(f"enter the working folder {spec['cwd']}")
        os.chdir(spec["cwd"])
        steps.append("set rlimits")
        set_limits(spec["rlimits"])
        if spec.get("uid") is not None:
            steps.append(f"switch to uid {spec['uid']}")
            switch_user(spec["uid"], spec["gid"])
        steps.append("set no_new_privs")
        no_new_privs()
        os.umask(0o022)
        os.set_inheritable(status_fd, False)  # closed by a successful exec: the parent sees EOF
    except Exception as e:
        os.write(status_fd, f"cannot {steps[-1]}: {type(e).__name__}: {e}".encode())
        return 125
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        os.write(2, f"sandbox: cannot run {argv[0]!r}: {e.strerror}\n".encode())
        return 127 if isinstance(e, FileNotFoundError) else 126
    except Exception as e:  # anything else is still the command's failure to start, not a traceback
        os.write(2, f"sandbox: cannot run {argv[0]!r}: {type(e).__name__}: {e}\n".encode())
        return 126
    return 126  # not reached


if __name__ == "__main__":
    sys.exit(main())
