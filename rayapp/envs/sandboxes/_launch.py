"""Trampoline: turn a fresh process into a sandboxed command, then exec it.

``python -I -S _launch.py SPEC_JSON STATUS_FD -- ARGV...`` (run by ``LocalProcessSandbox``).

Why a separate interpreter instead of ``preexec_fn``: ``preexec_fn`` runs Python between fork and
exec in a child of a multi-threaded process (a Ray worker has many threads); a lock another thread
held at fork time can deadlock that child, and CPython documents it as unsafe with threads. A fresh
interpreter has no such state, costs ~30 ms, and does what util-linux's ``unshare``/``prlimit``/
``setpriv`` would do without needing them on the node. It imports only the standard library and
nothing from rayapp, so it runs before any privilege is dropped without trusting the project's path.

Order matters, and each step is done while it still can be:
1. unshare the network namespace (needs root, or a user namespace when unprivileged), bring its
   private loopback up; unshare the mount namespace and bind the sandbox's own tmp folder over /tmp
   and /var/tmp and an empty folder over the project checkout;
2. chdir into the working folder while still privileged (its parent may be closed to the sandbox user);
3. set the rlimits (a hard limit cannot be raised again after dropping privileges);
4. drop supplementary groups, then gid, then uid (real, effective and saved);
5. set no_new_privs, so a setuid binary cannot give root back;
6. exec the command.
A failure in steps 1-5 is written to STATUS_FD and the process exits 125: the parent reads it as a
sandbox fault. A successful exec closes STATUS_FD (close-on-exec), which the parent reads as EOF. A
command that cannot be found or run is the command's own outcome (exit 127/126, as a shell says).

Two more modes: ``{"probe": true}`` reports which isolation steps this kernel/privilege allows, as
JSON on STATUS_FD; ``{"kill_uid": N}`` becomes uid N and sends SIGKILL to every process of that
user with ``kill(-1)`` (atomic against fork bombs: the kernel walks the task list under a lock that
fork must take), then exits.
"""

# Everything is imported up front: after the uid switch the interpreter's own standard library may
# be unreadable (a pyenv under /root), so a lazy import there would fail.
import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
import warnings  # noqa: F401  os.execvp imports it lazily

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
PR_SET_NO_NEW_PRIVS = 38


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags):
    if hasattr(os, "unshare"):  # Python 3.12+
        os.unshare(flags)
        return
    if _libc().unshare(flags) != 0:
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


def _mount(source, target, flags):
    if _libc().mount(source, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _mount_point(top, rel):
    """An fd of folder ``top/rel``, made where missing. The folders are in the sandbox's own tmp,
    which its user may have changed between commands: walked one component at a time without
    following symlinks, so root never creates or mounts anything outside it."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(top, flags)
    for part in rel.split("/"):
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o711, dir_fd=fd)
            sub = os.open(part, flags, dir_fd=fd)
        finally:
            os.close(fd)
        fd = sub
    return fd


def private_mounts(spec):
    """In this process's own mount namespace: the sandbox's tmp folder is /tmp and /var/tmp, and
    each path of ``hide`` (the project checkout) is covered by an empty folder. If the sandbox's
    folder itself lives under /tmp, it is bound back at its own path so cwd, HOME and TMPDIR still
    resolve."""
    base, tmp, empty = spec["base"], spec["tmp"], spec["empty"]
    base_fd = os.open(base, os.O_PATH | os.O_CLOEXEC)  # reachable after /tmp is covered
    tmp_fd = os.open(tmp, os.O_PATH | os.O_CLOEXEC)
    try:
        # Private propagation first, or the binds below would show up in the host's namespace.
        _mount(None, "/", MS_REC | MS_PRIVATE)
        for path in spec.get("hide", ()):
            _mount(empty.encode(), path, MS_BIND)
        for path in ("/tmp", "/var/tmp"):
            if os.path.isdir(path):
                _mount(f"/proc/self/fd/{tmp_fd}".encode(), path, MS_BIND)
        for top in ("/tmp", "/var/tmp"):
            if base.startswith(top + "/"):
                target = _mount_point(top, base[len(top) + 1:])
                try:
                    _mount(f"/proc/self/fd/{base_fd}".encode(), f"/proc/self/fd/{target}", MS_BIND)
                finally:
                    os.close(target)
                break
    finally:
        os.close(base_fd)
        os.close(tmp_fd)


def switch_user(uid, gid):
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def no_new_privs():
    if _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
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


def probe(spec):
    report = {"net": None, "user": None, "mount": None}
    try:
        isolate_network()
    except OSError as e:
        report["net"] = f"{type(e).__name__}: {e}"
    try:
        # After the network step's user namespace (unprivileged) or as root: what a command gets.
        _unshare(CLONE_NEWNS) if report["net"] is None else enter_namespaces(CLONE_NEWNS)
        _mount(None, "/", MS_REC | MS_PRIVATE)
    except OSError as e:
        report["mount"] = f"{type(e).__name__}: {e}"
    if spec.get("uid") is not None:
        try:
            switch_user(spec["uid"], spec["gid"])
        except OSError as e:
            report["user"] = f"{type(e).__name__}: {e}"
    return report


def kill_uid(uid):
    switch_user(uid, uid)
    for _ in range(100):
        try:
            os.kill(-1, signal.SIGKILL)  # every process of this uid except ourselves
        except ProcessLookupError:
            return  # none left
        except PermissionError:
            return


def main():
    spec, status_fd, argv = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[4:]
    if spec.get("probe"):
        os.write(status_fd, json.dumps(probe(spec)).encode())
        return 0
    if spec.get("kill_uid") is not None:
        kill_uid(spec["kill_uid"])
        return 0
    step = "start"
    try:
        if spec.get("isolate_network"):
            step = "isolate the network"
            isolate_network()
        if spec.get("mounts"):
            step = "set up the private /tmp"
            # Inside the network step's user namespace, if it made one, a mount namespace needs no more.
            _unshare(CLONE_NEWNS) if spec.get("isolate_network") or os.geteuid() == 0 else enter_namespaces(CLONE_NEWNS)
            private_mounts(spec["mounts"])
        step = f"enter the working folder {spec['cwd']}"
        os.chdir(spec["cwd"])
        step = "set rlimits"
        set_limits(spec["rlimits"])
        if spec.get("uid") is not None:
            step = f"switch to uid {spec['uid']}"
            switch_user(spec["uid"], spec["gid"])
        step = "set no_new_privs"
        no_new_privs()
        os.umask(0o022)
        os.set_inheritable(status_fd, False)  # closed by a successful exec: the parent sees EOF
    except Exception as e:
        os.write(status_fd, f"cannot {step}: {type(e).__name__}: {e}".encode())
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
