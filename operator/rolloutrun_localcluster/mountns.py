"""Each pod its own filesystem view: the isolation mode, and a container's mount plan.

Why: with one shared filesystem a pod can write where no volume holds its files (a
``file://`` storage path, ``/tmp``) and still find them after a restart; on a real
cluster they die with the pod. In ``namespaces`` mode every container starts in a private
mount namespace (:mod:`.mountns_launch`) where its volumes are bound at their mount paths
(``subPath``, ``readOnly``), ``/tmp`` is the pod's own directory (shared by its
containers, deleted with the pod) unless a volume is mounted there, and the root is
read-only when ``securityContext.readOnlyRootFilesystem`` asks. The host root is the
pod's "image": its programs are seen, nothing is created on it.

``loopback`` mode is the fallback where mount namespaces are not permitted: volumes are
linked under ``$ROLLOUTRUN_LOCALCLUSTER_ROOT`` (:mod:`.volumes`). Chosen by
``LocalCluster(isolation=...)`` or ``$ROLLOUTRUN_LOCALCLUSTER_ISOLATION``; the default is
``namespaces`` where ``unshare -m true`` works. The node says which in its annotation
:data:`ISOLATION_ANNOTATION`.

The plan is pure (:func:`plan`), the launch is an argv prefix (:func:`launcher_prefix`)
so a network-namespace prefix (``nsenter --net=...``) composes in front of it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import marshal
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

Obj = dict[str, Any]

NAMESPACES, LOOPBACK = "namespaces", "loopback"
MODES = (NAMESPACES, LOOPBACK)
ENV_ISOLATION = "ROLLOUTRUN_LOCALCLUSTER_ISOLATION"
ISOLATION_ANNOTATION = "localcluster.rolloutrun.dev/isolation"
LAUNCHER = Path(__file__).with_name("mountns_launch.py")


@functools.cache
def namespaces_permitted() -> bool:
    """Whether this process may create mount namespaces (tried once: ``unshare -m true``)."""
    unshare = shutil.which("unshare")
    if unshare is None or not sys.platform.startswith("linux"):
        return False
    try:
        result = subprocess.run(
            [unshare, "--mount", "--propagation", "private", "true"],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def choose_mode(requested: str | None, environ: dict[str, str] | None = None) -> str:
    """The isolation mode: ``requested``, else ``$ROLLOUTRUN_LOCALCLUSTER_ISOLATION``, else
    ``namespaces`` where permitted. Asking for ``namespaces`` where it is not permitted is
    an error (a test that asks for it must not silently get the kinder mode)."""
    env = os.environ if environ is None else environ
    wanted = requested or env.get(ENV_ISOLATION) or ""
    if wanted and wanted not in MODES:
        raise ValueError(f"isolation must be one of {', '.join(MODES)}, not {wanted!r}")
    if wanted == LOOPBACK:
        return LOOPBACK
    if namespaces_permitted():
        return NAMESPACES
    if wanted == NAMESPACES:
        raise RuntimeError(
            "isolation=namespaces: this process may not create mount namespaces "
            "(`unshare -m true` failed); use isolation=loopback"
        )
    return LOOPBACK


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def plan(
    pod: Obj,
    container: Obj,
    volume_dirs: dict[str, str],
    pod_dir: str,
    tmp_dir: str,
    keep: list[str],
    hide: str = "",
) -> Obj:
    """The launcher's spec for one container (JSON-able; see :mod:`.mountns_launch`).

    ``volume_dirs``: each volume's directory on this machine (a claim's is its volume's).
    ``keep``: host paths the container must go on seeing (its programs: the PATH, the
    cluster's pod directory); only those a mount would hide are bound back, the pod
    directory always (writable: the local cluster's test pods write there). ``hide``: the
    cluster's directory, covered by an empty tmpfs (other pods' files and claims)."""
    mounts = []
    for mount in container.get("volumeMounts") or []:
        source = volume_dirs.get(mount["name"])
        if source is None:
            raise ValueError(f'volume "{mount["name"]}" not found')
        sub = mount.get("subPath") or ""
        target = "/" + mount["mountPath"].strip("/")
        mounts.append(
            {
                "source": os.path.join(source, sub) if sub else source,
                "target": target,
                "readOnly": bool(mount.get("readOnly")),
                "subPath": sub,
            }
        )
    if not any(m["target"] == "/tmp" for m in mounts):
        mounts.append({"source": tmp_dir, "target": "/tmp", "readOnly": False, "subPath": ""})
    mounts.sort(key=lambda m: m["target"].count("/"))
    targets = [m["target"] for m in mounts]
    hidden = [*targets, hide] if hide else targets
    # only what lies strictly below a mount: keeping a mount point itself (a PATH entry of
    # /tmp) would undo the mount
    below = {p for p in keep if any(_under(p, t) and p != t for t in hidden)}
    below -= set(targets)  # a volume mounted at a kept path is what the pod sees there
    kept = sorted(below | {pod_dir})
    security = container.get("securityContext") or {}
    return {
        "mounts": mounts,
        "keep": kept,
        "keepWritable": [pod_dir],
        "hide": [hide] if hide else [],
        "readOnlyRoot": bool(security.get("readOnlyRootFilesystem")),
        "workingDir": container.get("workingDir") or "",
    }


def keep_paths(env: dict[str, str]) -> list[str]:
    """Host paths a container's programs live in: its ``PATH``, ``PYTHONPATH``, the virtual
    environment and the interpreter's prefix (not the cluster's directory: other pods'
    files and the claims' directories are not the pod's to see)."""
    paths = [sys.prefix, sys.base_prefix, *_package_roots()]
    paths += [p for p in sys.path if os.path.isabs(p)]
    for name in ("PATH", "PYTHONPATH"):
        paths += [p for p in env.get(name, "").split(os.pathsep) if os.path.isabs(p)]
    if env.get("VIRTUAL_ENV"):
        paths.append(env["VIRTUAL_ENV"])
    return [os.path.normpath(p) for p in paths]


def _package_roots() -> list[str]:
    """Where the project's own packages live: an editable install maps them to its source
    tree, which is on no ``PATH``, ``PYTHONPATH`` or ``sys.path`` entry (a checkout under
    ``/tmp`` would vanish behind the pod's private ``/tmp``)."""
    roots = []
    for name in ("rolloutrun_runtime", "rolloutrun_operator", "rolloutrun_localcluster"):
        spec = importlib.util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append(os.path.dirname(location))
    return roots


def launcher_prefix(spec_path: Path) -> list[str]:
    """The argv prefix that starts a container in its mount namespace; ``--`` then the
    container's own argv follow. A network prefix may be put in front of it."""
    return [sys.executable, "-I", "-S", str(LAUNCHER), str(spec_path), "--"]


def launch(
    pod: Obj,
    container: Obj,
    env: dict[str, str],
    argv: list[str],
    pod_dir: Path,
    volume_dirs: dict[str, str],
    cluster_dir: Path,
) -> tuple[list[str], Path]:
    """The argv and host working directory that start ``container`` in namespace mode:
    behind :func:`launcher_prefix`, its spec written to the pod directory."""
    spec = plan(
        pod,
        container,
        volume_dirs,
        str(pod_dir),
        str(pod_tmp(pod_dir)),
        keep_paths(env),
        str(cluster_dir),
    )
    spec["stage"] = str(pod_dir / "mnt" / container["name"])
    spec_path = pod_dir / "mnt" / f"{container['name']}.plan"
    spec_path.parent.mkdir(mode=0o700, exist_ok=True)
    spec_path.write_bytes(marshal.dumps(spec))  # what the launcher reads (fast to load)
    spec_path.with_suffix(".json").write_text(json.dumps(spec, indent=1))  # for people
    return [*launcher_prefix(spec_path), *argv], pod_dir


def pod_tmp(pod_dir: Path) -> Path:
    """The pod's private ``/tmp`` on this machine (deleted with the pod)."""
    return pod_dir / "tmp"


def prepare_tmp(pod_dir: Path) -> None:
    pod_tmp(pod_dir).mkdir(exist_ok=True)
    pod_tmp(pod_dir).chmod(0o1777)


def remove_tmp(pod_dir: Path) -> None:
    shutil.rmtree(pod_tmp(pod_dir), ignore_errors=True)


def enter_prefix(pid: int, mode: str) -> list[str]:
    """The argv prefix that runs a command in the mount namespace, root and working
    directory of the container whose main process is ``pid`` (an exec probe); none in
    loopback mode."""
    if mode != NAMESPACES:
        return []
    return ["nsenter", "--target", str(pid), "--mount", "--root", "--wd", "--"]
