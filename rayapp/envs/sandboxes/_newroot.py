"""The root file system a sandboxed command sees, built by the launcher (``_launch.py``) inside the
command's own mount namespace, then entered with ``pivot_root``. Standard library only, like the
launcher, which loads it by path before any privilege is dropped.

The new root is a small tmpfs holding:
- the system's runtime, read-only: /usr, /bin, /sbin, /lib* (a symlink stays a symlink), any extra
  prefix the host names in ``ro`` (a Python outside /usr), and a short list of /etc entries that
  programs read (users, hosts, the dynamic linker's cache, certificates, time zone, git and Python's
  system config): nothing else of /etc;
- /dev with null, zero, full, random, urandom and tty only, and a fresh tmpfs on /dev/shm;
- a fresh tmpfs on /run/lock;
- /proc: a fresh proc of the command's own PID namespace, showing the command's own processes only
  (``hidepid=2`` hides init, which runs as root), or, where the kernel refuses one, the host's;
- the sandbox's own folder at its own path, read-write, and its tmp folder at /tmp and /var/tmp.
Nothing else: not the host's /tmp, /home, /root, /work, other sandboxes' folders, the project
checkout, Ray's session folder or token. The old root is detached after ``pivot_root``, so no path
leads back to it. Every mount is private to the command's namespace and vanishes with it.
"""

import contextlib
import ctypes
import os
import stat

LIBC = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 0x1, 0x2, 0x4, 0x8, 0x20
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 0x400, 0x800, 0x1000, 0x4000, 0x40000, 0x200000
MNT_DETACH, MS_MOVE = 2, 0x2000
# A bind mount's remount must keep the flags the kernel locked on its source (in a user namespace
# it refuses to clear them): statvfs flag -> mount flag.
_LOCKED = ((os.ST_RDONLY, MS_RDONLY), (os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV),
           (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
           (os.ST_RELATIME, MS_RELATIME))
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}  # no libc wrapper

SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
ETC = ("passwd", "group", "hosts", "hostname", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf",
       "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "timezone", "alternatives", "ssl",
       "ca-certificates", "mime.types", "gitconfig", "inputrc", "bash.bashrc", "profile", "shells", "os-release",
       "debian_version", "protocols", "services", "networks", "locale.alias", "terminfo", "mtab")
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
             ("stderr", "/proc/self/fd/2"))
LOCK_BYTES = 1 << 20


def _b(value):
    return value.encode() if isinstance(value, str) else value


def mount(source, target, flags, fstype=None, data=None):
    if LIBC.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype or source} on {target}: {os.strerror(err)}")


def _bind(source, target, readonly):
    mount(source, target, MS_BIND | MS_REC)
    if readonly:
        flag = os.statvfs(target).f_flag
        kept = sum(ms for st, ms in _LOCKED if flag & st)
        mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY | kept)


def _place(source, root, readonly=True):
    """``source`` of the host at the same path under ``root``: a symlink copied, a folder or file
    bound (read-only unless told). Absent on the host, or already placed: nothing."""
    target = root + source
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        return
    if os.path.lexists(target):
        return
    os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), target)
        return
    if stat.S_ISDIR(st.st_mode):
        os.mkdir(target, 0o755)
    else:
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    _bind(source, target, readonly)


def _tmpfs(target, size, mode="1777"):
    os.makedirs(target, 0o755, exist_ok=True)
    mount("tmpfs", target, MS_NOSUID | MS_NODEV, "tmpfs", f"mode={mode},size={size}")


def _mount_point(top, rel):
    """An fd of folder ``top/rel``, made where missing. ``top`` is the sandbox's own tmp, which its
    user may have changed between commands: walked one component at a time without following
    symlinks, so root never creates or mounts anything outside it."""
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


def _sandbox_folders(root, base, tmp):
    """The sandbox's tmp at /tmp and /var/tmp, and its folder at its own path, so cwd, HOME and
    TMPDIR resolve even when the folder lives under /tmp."""
    for top in ("/tmp", "/var/tmp"):
        os.makedirs(root + top, 0o755, exist_ok=True)
        mount(tmp, root + top, MS_BIND)
    for top in ("/tmp", "/var/tmp"):
        if base.startswith(top + "/"):
            target = _mount_point(root + top, base[len(top) + 1:])
            try:
                mount(base, f"/proc/self/fd/{target}", MS_BIND)
            finally:
                os.close(target)
            return
    os.makedirs(root + base, 0o755, exist_ok=True)
    mount(base, root + base, MS_BIND)


def _place_in_tmp(source, root):
    """A host folder under /tmp or /var/tmp (a venv there), read-only at its own path inside the
    sandbox's tmp, which covers those (mount points made as ``_mount_point`` makes them). Bound and
    made read-only at a stage only root sees, then moved there: a mount reached through its fd
    cannot be remounted read-only in place."""
    top = "/tmp" if source.startswith("/tmp/") else "/var/tmp"
    if not os.path.isdir(source):
        return
    stage = f"{root}/.rayapp-ro-stage"
    os.mkdir(stage, 0o700)
    try:
        _bind(source, stage, readonly=True)
        target = _mount_point(root + top, source[len(top) + 1:])
        try:
            mount(stage, f"/proc/self/fd/{target}", MS_MOVE)
        finally:
            os.close(target)
    finally:
        os.rmdir(stage)


def build_root(spec, own_proc):
    """Build the new root at ``spec["stage"]`` (an empty folder) and enter it. ``own_proc``: this
    process is the first of a new PID namespace, so a fresh /proc shows that namespace only."""
    root = spec["stage"]
    # Private propagation first, or the mounts below would show up in the host's namespace.
    mount(None, "/", MS_REC | MS_PRIVATE)
    mount("tmpfs", root, MS_NOSUID | MS_NODEV, "tmpfs", "mode=0755,size=1m")
    for name in SYSTEM:
        _place(f"/{name}", root)
    # A prefix under /tmp or /var/tmp would be covered by the sandbox's own tmp: it goes in after that.
    late = [p for p in spec.get("ro", ()) if spec.get("base") and p.startswith(("/tmp/", "/var/tmp/"))]
    for path in spec.get("ro", ()):
        if path not in late:
            _place(path, root)
    for name in sorted(os.listdir("/etc")):
        if name in ETC or name.startswith("python"):
            _place(f"/etc/{name}", root)
    for name in DEVICES:
        _place(f"/dev/{name}", root, readonly=False)
    for name, target in DEV_LINKS:
        os.symlink(target, f"{root}/dev/{name}")
    _tmpfs(f"{root}/dev/shm", spec["shm_bytes"])
    _tmpfs(f"{root}/run/lock", LOCK_BYTES)
    os.mkdir(f"{root}/proc", 0o555)
    if own_proc:
        # hidepid=2: the sandbox user sees its own processes only, not init (root), whose command
        # line names the sandbox's paths.
        mount("proc", f"{root}/proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "proc", "hidepid=2")
    else:
        _bind("/proc", f"{root}/proc", readonly=False)
    if spec.get("base"):
        _sandbox_folders(root, spec["base"], spec["tmp"])
        for path in late:
            _place_in_tmp(path, root)
    _pivot(root)


def _pivot(root):
    number = _PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(0, f"pivot_root: no syscall number known for {os.uname().machine}")
    os.chdir(root)
    # pivot_root(".", "."): the old root ends up stacked under the new one, then is detached.
    if LIBC.syscall(number, b".", b".") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root {root}: {os.strerror(err)}")
    if LIBC.umount2(b".", MNT_DETACH) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"detach the old root: {os.strerror(err)}")
    os.chdir("/")
