"""Pod-side setup: sets the hostname and the mounts inside a pod, then execs the pod's command.

``NetnsPod.spawn`` runs this file between ``unshare`` and the command; every step of the chain execs
the next, so the pid ``Popen`` returns is the command's own::

    ip netns exec rfn<id>-<host>   joins the pod's network namespace (ip also unshares a mount
                                   namespace, makes / a slave and mounts a sysfs for that netns)
    unshare --uts --mount --propagation private
                                   own hostname; own mounts, none of which reach the host
    python -I -S podinit.py SPEC -- COMMAND...
                                   this file: hostname, bind mounts (/etc/hosts and
                                   /etc/resolv.conf among them) and tmpfs mounts, cwd; then exec
    COMMAND...

It runs by path with ``-I -S`` and imports only the standard library, so the pod's environment
(PYTHONPATH, a venv) cannot change it. Exit status 125 means the setup failed (the reason is on
stderr); 126 and 127 mean the command could not be executed or was not found.

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

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
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


def setup(spec):
    socket.sethostname(spec["hostname"])
    drop_netns_handles()
    # Open every source before mounting anything: a later mount could hide a source path.
    sources = []
    for m in spec["mounts"]:
        if m.get("tmpfs") is not None:  # a memory-backed volume: no source, mounted fresh
            sources.append((None, True, m["tmpfs"], m["target"], m["ro"]))
            continue
        try:
            fd = os.open(m["source"], os.O_PATH | os.O_CLOEXEC)
        except OSError as exc:
            raise SetupError(f"mount source {m['source']}: {exc.strerror}") from None
        sources.append((fd, stat.S_ISDIR(os.fstat(fd).st_mode), m["source"], m["target"], m["ro"]))
    sources.sort(key=lambda s: s[3].count("/"))  # parents before children
    cwd = spec.get("cwd") or os.getcwd()
    stage = spec["stage"]  # an empty host directory; only this namespace mounts on it
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

    scratch = None
    layers = 0
    for fd, is_dir, source, target, ro in sources:
        existing, missing = split_existing(target)
        if missing:
            if existing not in ours:
                if scratch is None:
                    scratch = stage  # after a chroot this is the plain host directory again
                    mount("tmpfs", scratch, "tmpfs", 0, "mode=700")
                layers += 1
                layer = os.path.join(scratch, str(layers))
                os.mkdir(layer)
                mount("tmpfs", layer, "tmpfs", 0, "mode=755")
                replicate(existing, layer)
                mount(layer, existing, flags=MS_MOVE)
                ours.add(existing)
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
            keep = os.statvfs(target).f_flag & KEEP_FLAGS
            mount(None, target, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | keep)
        os.close(fd)
    if scratch is not None:
        umount(scratch)  # the layers were moved away; the pod sees the empty directory again
    os.chdir(cwd)


def main(argv):
    spec = json.loads(argv[1])
    command = argv[3:]  # argv[2] is "--"
    try:
        setup(spec)
    except (SetupError, OSError) as exc:
        fail(spec, f"setup failed: {exc}", SETUP_FAILED)
    try:
        os.execvp(command[0], command)
    except FileNotFoundError:
        fail(spec, f"{command[0]}: command not found", 127)
    except OSError as exc:
        fail(spec, f"{command[0]}: {exc.strerror}", 126)


def fail(spec, message, status):
    print(f"resilient-fsdp pod {spec['hostname']}: {message}", file=sys.stderr, flush=True)
    os._exit(status)


if __name__ == "__main__":
    main(sys.argv)
