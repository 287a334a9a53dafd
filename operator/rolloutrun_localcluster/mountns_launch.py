"""The container launcher of namespace mode: a private mount namespace, then ``execve``.

Run by the process kubelet as ``python -I -S mountns_launch.py PLAN -- ARGV...`` (standard
library only, no package import). PLAN is the plan of :mod:`.mountns` in ``marshal``
format (the same interpreter writes and reads it; importing ``json`` costs 20 ms, and
``typing`` 10 ms, so neither is imported), a JSON copy beside it for people: the volumes
to bind at their mount paths, the host paths the pod keeps seeing (its node's "image"),
the host paths it must not see (the cluster's directory: other pods' files, claims it did
not mount), whether the root is read-only and the working directory. Why a process and
not ``preexec_fn``: the cluster's loop runs in a thread, and forking a threaded Python to
run Python before ``exec`` can deadlock.

Mount points that do not exist are never created on the host. The deepest existing
ancestor gets an overlay (the host's directory below, a tmpfs above, where the missing
path is made) when nothing is mounted under it; otherwise it is mirrored on a tmpfs (each
entry bound back, submounts with it) moved over it. Either way only in this namespace;
when the ancestor is ``/`` the mirror becomes the root (``chroot``).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import sys

TYPE_CHECKING = False  # not ``typing.TYPE_CHECKING``: importing typing costs 10 ms
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 4096, 8192, 16384, 1 << 18
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (new syscall table)

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source} on {target}",
    )


def set_readonly(target: str, readonly: bool, recursive: bool) -> None:
    attr = _MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY)
    flags = AT_RECURSIVE if recursive else 0
    result = _libc.syscall(
        SYS_MOUNT_SETATTR,
        AT_FDCWD,
        target.encode(),
        flags,
        ctypes.byref(attr),
        ctypes.sizeof(attr),
    )
    _check(result, f"mount_setattr {target}")


class Launcher:
    def __init__(self, stage: str) -> None:
        os.makedirs(stage, mode=0o700, exist_ok=True)
        self._stage = os.open(stage, os.O_PATH | os.O_DIRECTORY)
        self._mirrors = 0

    def _stage_path(self) -> str:
        self._mirrors += 1
        path = f"/proc/self/fd/{self._stage}/{self._mirrors}"
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def mirror(self, ancestor: str, missing: str, is_file: bool) -> None:
        """Make ``missing`` (below the existing ``ancestor``) on a tmpfs copy of it."""
        stage = self._stage_path()
        mode = os.stat(ancestor).st_mode & 0o7777
        mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o}")
        for name in os.listdir(ancestor):
            source, copy = os.path.join(ancestor, name), os.path.join(stage, name)
            if os.path.islink(source):
                os.symlink(os.readlink(source), copy)
                continue
            if os.path.isdir(source):
                os.mkdir(copy)
            else:
                open(copy, "wb").close()
            try:
                mount(source, copy, None, MS_BIND | MS_REC)
            except OSError as error:
                print(f"mountns: {error}", file=sys.stderr)
        inside = os.path.join(stage, os.path.relpath(missing, ancestor))
        _make(inside, is_file)
        if ancestor == "/":
            root = os.open(stage, os.O_PATH | os.O_DIRECTORY)
            mount(stage, "/", None, MS_MOVE)
            os.fchdir(root)
            os.chroot(".")
            os.chdir("/")
            os.close(root)
        else:
            mount(stage, ancestor, None, MS_MOVE)

    def overlay(self, ancestor: str, missing: str, is_file: bool) -> None:
        """Make ``missing`` on a tmpfs layered over the existing ``ancestor``."""
        stage = self._stage_path()
        mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
        upper, work = os.path.join(stage, "upper"), os.path.join(stage, "work")
        os.mkdir(upper)
        os.mkdir(work)
        os.chmod(upper, os.stat(ancestor).st_mode & 0o7777)
        _make(os.path.join(upper, os.path.relpath(missing, ancestor)), is_file)
        options = f"lowerdir={ancestor},upperdir={upper},workdir={work}"
        mount("overlay", ancestor, "overlay", 0, options)

    def ensure(self, target: str, is_file: bool, writable: set[str]) -> None:
        """``target`` exists: made inside a writable volume, else on a mirror."""
        if os.path.lexists(target):
            return
        ancestor = os.path.dirname(target)
        while not os.path.isdir(ancestor):
            ancestor = os.path.dirname(ancestor)
        if any(ancestor == w or ancestor.startswith(w.rstrip("/") + "/") for w in writable):
            _make(target, is_file)
        elif ancestor != "/" and not _has_submounts(ancestor):
            self.overlay(ancestor, target, is_file)
        else:
            self.mirror(ancestor, target, is_file)


def _has_submounts(directory: str) -> bool:
    """Whether anything is mounted at or below ``directory`` (an overlay would hide it)."""
    prefix = directory.rstrip("/") + "/"
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            point = line.split(" ", 5)[4].replace("\\040", " ")
            if point == directory or point.startswith(prefix):
                return True
    return False


def _make(path: str, is_file: bool) -> None:
    if is_file:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "ab").close()
    else:
        os.makedirs(path, exist_ok=True)


def binding_order(
    mounts: list[dict[str, Any]], sources: list[int], kept: list[tuple[str, int]]
) -> list[tuple[str, int, dict[str, Any] | None]]:
    """The volumes (with their item) and the kept paths (item None) as one list, shallowest
    target first: a volume mounted below a kept path is bound after it, on top of it. Kept
    paths bound last covered the volumes below them (a checkout under ``/tmp`` kept behind
    the pod's private ``/tmp``, the run's claim under it): the pod wrote to the host's
    directory instead of its volume, and with a read-only root its volume was no mount
    point (``mount_setattr ... Invalid argument``). Stable: at one depth, volumes first."""
    steps: list[tuple[str, int, dict[str, Any] | None]] = [
        (item["target"], fd, item) for item, fd in zip(mounts, sources, strict=True)
    ]
    steps += [(path, fd, None) for path, fd in kept]
    return sorted(steps, key=lambda step: step[0].rstrip("/").count("/"))


def setup(spec: dict[str, Any]) -> None:
    """Build the container's mounts in this process's (new) mount namespace."""
    _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    launcher = Launcher(spec["stage"])
    kept = [
        (path, os.open(path, os.O_PATH)) for path in spec.get("keep", []) if os.path.exists(path)
    ]
    # Sources are opened before any mount: a private /tmp may hide the cluster's directory.
    sources = [os.open(item["source"], os.O_PATH) for item in spec["mounts"]]
    writable: set[str] = set()
    for path in spec.get("hide", []):  # the cluster's directory: other pods, claims
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
            writable.add(path)
    for target, fd, item in binding_order(spec["mounts"], sources, kept):
        source = f"/proc/self/fd/{fd}"
        launcher.ensure(target, not os.path.isdir(source), writable)
        mount(source, target, None, MS_BIND | MS_REC)
        os.close(fd)
        if item is None:  # a kept path, bound onto itself: a mount point, for set_readonly
            continue
        if item.get("readOnly"):
            mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
        else:
            writable.add(target)
    if spec.get("workingDir"):  # a container runtime makes a missing working directory
        launcher.ensure(spec["workingDir"], False, writable)
    if spec.get("readOnlyRoot"):
        set_readonly("/", True, recursive=True)
        for path in ("/dev", "/proc"):
            set_readonly(path, False, recursive=True)
        for item in spec["mounts"]:
            if not item.get("readOnly"):
                set_readonly(item["target"], False, recursive=False)
        for path in spec.get("keepWritable", []):
            set_readonly(path, False, recursive=True)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: mountns_launch.py SPEC -- ARGV...", file=sys.stderr)
        return 127
    with open(argv[1], "rb") as handle:
        spec = marshal.load(handle)
    try:
        setup(spec)
        os.chdir(spec.get("workingDir") or "/")
    except OSError as error:
        print(f"mountns: {error}", file=sys.stderr)
        return 128
    try:
        os.execv(argv[3], argv[3:])
    except OSError as error:
        print(f"mountns: exec {argv[3]}: {error}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
