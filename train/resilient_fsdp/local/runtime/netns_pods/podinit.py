"""Pod-side setup: sets the hostname and the mounts inside a pod, then execs the pod's command.

``NetnsPod.spawn`` runs this file between ``unshare`` and the command (:func:`main` shows the
chain): the hostname, each init container in order, the container's mounts, then what a container
runtime applies (:func:`become`), then exec. A mount point whose parent is missing is made
without writing to the host (:class:`Layers`).

It runs by path with ``-I -S`` and imports only the standard library, so the pod's environment
(PYTHONPATH, a venv) cannot change it. Exit status 125 means the setup failed (the reason is on
stderr); 126 and 127 mean the command could not be executed or was not found.
"""

import ctypes
import json
import os
import socket
import stat
import sys

MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_UNBINDABLE = 0x20000
MNT_DETACH = 0x2
# statvfs flags a read-only bind remount must repeat to keep them (they equal the MS_* values).
KEEP_FLAGS = 0x2 | 0x4 | 0x8 | 0x400 | 0x800 | 0x1000  # nosuid nodev noexec noatime nodiratime relatime
SETUP_FAILED = 125
CLONE_NEWNS = 0x20000
MS_PRIVATE = 0x40000
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
# A container sees these as the runtime sets them up (its own /proc, /sys, /dev): never remounted.
KERNEL_TREES = ("/proc", "/sys", "/dev")

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        _libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return _libc


class SetupError(Exception):
    pass


def _b(value):
    return None if value is None else os.fsencode(value)


def mount(source, target, fstype=None, flags=0, data=None):
    if libc().mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise SetupError(f"mount {source or fstype} on {target} (flags {flags:#x}): {os.strerror(err)}")


def umount(target):
    if libc().umount2(_b(target), MNT_DETACH) != 0:
        raise SetupError(f"umount {target}: {os.strerror(ctypes.get_errno())}")


def mount_points():
    """Mount points of this mount namespace, decoding mountinfo's octal escapes (\\040 = space)."""
    with open("/proc/self/mountinfo", "rb") as f:
        return [os.fsdecode(line.split()[4].decode("unicode_escape").encode("latin-1")) for line in f]


def drop_netns_handles():
    """Detach the copies of /run/netns/* this namespace inherited.

    Each is a reference to a namespace: kept here, it would keep another pod's (or run's)
    namespace alive after ``ip netns del`` for as long as this pod lives.
    """
    for point in mount_points():
        if point.startswith("/run/netns/"):
            try:
                umount(point)
            except SetupError:
                pass  # already gone with an enclosing detach


def replicate(src, dst):
    """Fill the empty tmpfs root ``dst`` with a bind mount (or symlink copy) of each entry of ``src``."""
    st = os.stat(src)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.chown(dst, st.st_uid, st.st_gid)
    for entry in os.scandir(src):
        target = os.path.join(dst, entry.name)
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
            link = entry.stat(follow_symlinks=False)
            os.lchown(target, link.st_uid, link.st_gid)
        elif entry.is_dir(follow_symlinks=False):
            os.mkdir(target)
            mount(entry.path, target, flags=MS_BIND | MS_REC)  # recursive: submounts come along
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            mount(entry.path, target, flags=MS_BIND)


def split_existing(path):
    """(deepest existing ancestor of ``path``, resolved; the missing components below it)."""
    parts = [p for p in path.split("/") if p]
    current = "/"
    for i, part in enumerate(parts):
        nxt = os.path.join(current, part)
        if not os.path.lexists(nxt):
            return os.path.realpath(current), parts[i:]
        current = nxt
    return os.path.realpath(current), []


class Layers:
    """Private copies of existing directories (a tmpfs holding a bind of each entry) on the
    stage directory, each moved over its original: where a missing mount point can be made, or
    a directory's mode changed, without touching the host.

    A mount point whose parent is missing (``/checkpoints``, ``/etc/resilient-fsdp/config.yaml``) is
    made without writing to the host: the deepest existing ancestor is shadowed by a tmpfs holding a
    bind mount of each of its entries, plus the new directories. Unlike an overlay with that ancestor
    as lowerdir, the binds keep the mounts beneath it and keep writes to existing paths reaching the
    host. The root itself cannot be mounted over for this process (a process keeps its old root), so
    for a missing top-level directory the pod gets a new root built that way, entered with chroot.
    A shadowed directory's own entry list is a snapshot: entries the pod creates directly in it stay
    in the pod's tmpfs, and entries the host adds to it later do not appear in the pod (everything
    below those entries is the host's, live).
    """

    def __init__(self, stage, ours):
        self.stage, self.ours, self.scratch, self.count = stage, ours, None, 0

    def shadow(self, existing, extra_mode=0):
        if self.scratch is None:
            self.scratch = self.stage  # after a chroot this is the plain host directory again
            mount("tmpfs", self.scratch, "tmpfs", 0, "mode=700")
        self.count += 1
        layer = os.path.join(self.scratch, str(self.count))
        os.mkdir(layer)
        mount("tmpfs", layer, "tmpfs", 0, "mode=755")
        replicate(existing, layer)
        if extra_mode:
            os.chmod(layer, stat.S_IMODE(os.stat(layer).st_mode) | extra_mode)
        mount(layer, existing, flags=MS_MOVE)
        self.ours.add(existing)

    def close(self):
        if self.scratch is not None:
            umount(self.scratch)  # the layers were moved away; the pod sees the empty directory again
            self.scratch = None


def make_traversable(spec):
    """Search permission for every user on the ``traverse`` directories (shallowest first): a
    private copy whose mode adds it, as an image installs its Python readable by every user (this
    machine's interpreter may sit under a 0700 /root)."""
    layers = Layers(spec["stage"], set())
    for path in sorted(spec.get("traverse") or [], key=lambda p: p.count("/")):
        search = stat.S_IXGRP | stat.S_IXOTH  # group too: a user in the owner's group is judged by it
        if os.path.isdir(path) and os.stat(path).st_mode & search != search:
            layers.shadow(path, search)
    layers.close()


def setup(mounts, stage, cwd=None):
    """Mount ``mounts`` (the container's volumes) in this mount namespace; then ``cwd``."""
    # Open every source before mounting anything: a later mount could hide a source path.
    sources = []
    for m in mounts:
        if m.get("tmpfs") is not None:  # a memory-backed volume: no source, mounted fresh
            sources.append((None, True, m["tmpfs"], m["target"], m["ro"]))
            continue
        try:
            fd = os.open(m["source"], os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            raise SetupError(f"mount source {m['source']}: {exc.strerror}") from None
        sources.append((fd, stat.S_ISDIR(os.fstat(fd).st_mode), m["source"], m["target"], m["ro"]))
    sources.sort(key=lambda s: s[3].count("/"))  # parents before children
    cwd = cwd or os.getcwd()
    ours = set()  # directories on our own tmpfs layers, where creating entries touches no host fs

    # A missing top-level directory: only a new root can hold it.
    if any(not os.path.lexists("/" + target.split("/")[1]) for *_, target, _ in sources):
        # Unbindable, so the recursive bind of /run below does not copy the new root into itself.
        mount("tmpfs", stage, "tmpfs", 0, "mode=700")
        mount(None, stage, flags=MS_UNBINDABLE)
        root = os.path.join(stage, "root")
        os.mkdir(root)
        mount("tmpfs", root, "tmpfs", 0, "mode=755")
        replicate("/", root)
        os.chdir(root)
        os.chroot(".")
        ours.add("/")

    layers = Layers(stage, ours)
    for fd, is_dir, source, target, ro in sources:
        existing, missing = split_existing(target)
        if missing:
            if existing not in ours:
                layers.shadow(existing)
            path = existing
            for i, part in enumerate(missing):
                path = os.path.join(path, part)
                if i == len(missing) - 1 and not is_dir:
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
                else:
                    os.mkdir(path, 0o755)
                    ours.add(path)
        elif os.path.isdir(target) != is_dir:
            kind = "directory" if is_dir else "file"
            raise SetupError(f"cannot mount the {kind} {source} on {target}: not a {kind} in the pod")
        if fd is None:
            mount("tmpfs", target, "tmpfs", MS_RDONLY if ro else 0, source)  # source: the tmpfs options
            continue
        mount(f"/proc/self/fd/{fd}", target, flags=MS_BIND | (MS_REC if is_dir else 0))
        if ro:
            remount_read_only(target)
        os.close(fd)
    layers.close()
    os.chdir(cwd)


def remount_read_only(target):
    keep = os.statvfs(target).f_flag & KEEP_FLAGS
    mount(None, target, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | keep)


def read_only_root(mounts):
    """``readOnlyRootFilesystem``: every mount of this namespace read-only but the container's
    writable volumes (and what lies below them) and the kernel's trees."""
    writable = [m["target"].rstrip("/") for m in mounts if not m["ro"]]

    def under(path, tops):
        return any(path == t or path.startswith(t + "/") for t in tops)

    for point in sorted(set(mount_points()), key=lambda p: p.count("/")):
        if under(point, writable) or under(point, KERNEL_TREES):
            continue
        if os.statvfs(point).f_flag & MS_RDONLY:
            continue
        remount_read_only(point)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def prctl(option, arg2=0):
    if libc().prctl(option, arg2, 0, 0, 0) != 0:
        raise SetupError(f"prctl({option}, {arg2}): {os.strerror(ctypes.get_errno())}")


def become(security, nofile):
    """Last, after the mounts: the ``nofile`` limit, the capability bounding set, no inheritable
    or ambient capabilities, the groups and the user; ``no_new_privs``. For root, exec makes the
    bounding set the effective one; another user starts with no capabilities. Dropped capabilities
    cannot come back."""
    if nofile:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, tuple(nofile))
    keep = set(security["caps"])
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header, data = CapHeader(LINUX_CAPABILITY_VERSION_3, 0), (CapData * 2)()
    if libc().capget(ctypes.byref(header), data) != 0:
        raise SetupError(f"capget: {os.strerror(ctypes.get_errno())}")
    for d in data:
        d.inheritable = 0
    if libc().capset(ctypes.byref(header), data) != 0:
        raise SetupError(f"capset: {os.strerror(ctypes.get_errno())}")
    uid, gid = security["uid"], security["gid"]
    if gid is None and uid is not None:
        gid = 0  # no /etc/passwd entry for the user in the image: the runtime's group 0
    os.setgroups(security["groups"])
    if gid is not None:
        os.setresgid(gid, gid, gid)
    if uid is not None:
        os.setresuid(uid, uid, uid)
    if security["no_new_privs"]:
        prctl(PR_SET_NO_NEW_PRIVS, 1)


def run_init(spec, init):
    """One init container, to completion, in a child with its own mount namespace: 0, or the
    status the pod fails with."""
    pid = os.fork()
    if pid == 0:
        try:
            if libc().unshare(CLONE_NEWNS) != 0:
                raise SetupError(f"unshare: {os.strerror(ctypes.get_errno())}")
            mount(None, "/", flags=MS_REC | MS_PRIVATE)
            setup(init["mounts"], spec["stage"], "/")
            if init["security"]["read_only_root"]:
                read_only_root(init["mounts"])
            become(init["security"], spec.get("nofile"))
        except (SetupError, OSError, ValueError) as exc:
            fail(spec, f"init container {init['name']}: setup failed: {exc}", SETUP_FAILED)
        exec_command(spec, init["argv"], init["env"], f"init container {init['name']}: ")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def exec_command(spec, command, env=None, what=""):
    try:
        if env is None:
            os.execvp(command[0], command)
        os.execvpe(command[0], command, env)
    except FileNotFoundError:
        fail(spec, f"{what}{command[0]}: command not found", 127)
    except OSError as exc:
        fail(spec, f"{what}{command[0]}: {exc.strerror}", 126)


def main(argv):
    """``NetnsPod.spawn`` runs this file between ``unshare`` and the command; every step of the chain execs
    the next, so the pid ``Popen`` returns is the command's own::

        ip netns exec rfn<id>-<host>   joins the pod's network namespace (ip also unshares a mount
                                       namespace, makes / a slave and mounts a sysfs for that netns)
        unshare --uts --mount --propagation private
                                       own hostname; own mounts, none of which reach the host
        python -I -S podinit.py SPEC -- COMMAND...
                                       this file: hostname; then each init container in a child
                                       with a mount namespace of its own, in order, each waited
                                       for; then the trainer container's bind mounts (/etc/hosts and
                                       /etc/resolv.conf among them) and tmpfs mounts, cwd; then,
                                       last, what a container runtime applies (:func:`become`); then exec
        COMMAND...
    """
    spec = json.loads(argv[1])
    command = argv[3:]  # argv[2] is "--"
    try:
        socket.sethostname(spec["hostname"])
        drop_netns_handles()
        make_traversable(spec)
    except (SetupError, OSError) as exc:
        fail(spec, f"setup failed: {exc}", SETUP_FAILED)
    for init in spec.get("inits") or []:
        code = run_init(spec, init)
        if code != 0:
            fail(spec, f"init container {init['name']} exited with status {code}: the pod fails", code)
    try:
        setup(spec["mounts"], spec["stage"], spec.get("cwd"))
        security = spec.get("security")
        if security:
            if security["read_only_root"]:
                read_only_root(spec["mounts"])
            become(security, spec.get("nofile"))
    except (SetupError, OSError, ValueError) as exc:
        fail(spec, f"setup failed: {exc}", SETUP_FAILED)
    exec_command(spec, command)


def fail(spec, message, status):
    print(f"resilient-fsdp pod {spec['hostname']}: {message}", file=sys.stderr, flush=True)
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv)
