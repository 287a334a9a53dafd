"""Pod volumes as plain directories: ConfigMap, Secret, downward API, emptyDir and claims.

Each volume is written once at pod start to ``<pod dir>/volumes/<volume name>/`` (a
PersistentVolumeClaim's directory is its bound volume's, under the cluster's ``volumes/``,
shared by every pod that mounts it). In namespace mode (:mod:`.mountns`) each container
sees them bound at their mount paths. In loopback mode there is no mount namespace: each
is linked at ``<pod dir>/root/<mountPath>``; a path P inside the container is
``$ROLLOUTRUN_LOCALCLUSTER_ROOT/P`` on this machine. Later ConfigMap and Secret
changes are not propagated. Volume directories are 0700 and their files 0600 (a Secret's
files must not be readable by other users of the machine; ``defaultMode`` is not emulated).
"""

from __future__ import annotations

import base64
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import mountns
from .kubeconfig import private_dir, write_private
from .podspec import ConfigError, downward_value

if TYPE_CHECKING:
    from .kubelet import Kubelet
    from .podworker import PodWorker

logger = logging.getLogger(__name__)

Obj = dict[str, Any]


def volume_files(volume: Obj, pod: Obj, kubelet: Kubelet) -> dict[str, bytes] | None:
    """Files of one volume (relative path to content); ``None`` for an emptyDir or unknown."""
    namespace = pod["metadata"]["namespace"]
    if "configMap" in volume or "secret" in volume:
        is_secret = "secret" in volume
        source = volume["secret" if is_secret else "configMap"]
        name = source.get("secretName" if is_secret else "name", "")
        obj = kubelet.lookup("secrets" if is_secret else "configmaps")(namespace, name)
        if obj is None:
            if source.get("optional"):
                return {}
            raise ConfigError(f'{"secret" if is_secret else "configmap"} "{name}" not found')
        data = {
            k: base64.b64decode(v) if is_secret else str(v).encode()
            for k, v in (obj.get("data") or {}).items()
        }
        if not is_secret:
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        items = source.get("items")
        if items:
            return {item["path"]: data[item["key"]] for item in items if item["key"] in data}
        return data
    if "downwardAPI" in volume:
        files = {}
        for item in volume["downwardAPI"].get("items") or []:
            if "fieldRef" in item:
                files[item["path"]] = downward_value(
                    pod, item["fieldRef"].get("fieldPath", "")
                ).encode()
        return files
    return None


class Volumes:
    def __init__(self, kubelet: Kubelet) -> None:
        self.kubelet = kubelet

    def claim_dir(self, namespace: str, volume: Obj) -> str | None:
        """The directory of the volume bound to a claim volume's claim (None if unbound)."""
        claim = self.kubelet.lookup("persistentvolumeclaims")(
            namespace, volume["persistentVolumeClaim"].get("claimName", "")
        )
        bound = ((claim or {}).get("spec") or {}).get("volumeName")
        pv = self.kubelet.lookup("persistentvolumes")("", bound) if bound else None
        spec = (pv or {}).get("spec") or {}
        path = (spec.get("hostPath") or spec.get("local") or {}).get("path")
        return str(path) if path else None

    def dirs(self, worker: PodWorker, pod: Obj) -> dict[str, str]:
        """Each volume's directory on this machine."""
        result = {}
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            path = None
            if "persistentVolumeClaim" in volume:
                path = self.claim_dir(worker.namespace, volume)
            result[volume["name"]] = path or str(worker.dir / "volumes" / volume["name"])
        return result

    def namespaced(
        self, worker: PodWorker, container: Obj, env: dict[str, str], argv: list[str]
    ) -> tuple[list[str], Path]:
        """``argv`` and the working directory that start ``container`` in its own mount
        namespace (namespace mode)."""
        pod = self.kubelet.pod(worker.uid)
        if pod is None:
            raise ConfigError("the pod is gone")
        return mountns.launch(
            pod, container, env, argv, worker.dir, self.dirs(worker, pod), self.kubelet.root
        )

    def materialize(self, worker: PodWorker) -> None:
        pod = self.kubelet.pod(worker.uid)
        if pod is None:
            return
        mountns.prepare_tmp(worker.dir)
        root = private_dir(worker.dir / "volumes")
        sources = self.dirs(worker, pod)
        for volume in (pod.get("spec") or {}).get("volumes") or []:
            target = private_dir(root / volume["name"])
            try:
                files = volume_files(volume, pod, self.kubelet)
            except ConfigError as error:
                logger.warning(
                    "volume %s of pod %s/%s: %s",
                    volume["name"],
                    worker.namespace,
                    worker.name,
                    error,
                )
                continue
            for relative, content in (files or {}).items():
                path = target / relative
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_private(path, content)
        for container in (pod.get("spec") or {}).get("initContainers", []) + (
            pod.get("spec") or {}
        ).get("containers", []):
            for mount in container.get("volumeMounts") or []:
                sub = mount.get("subPath", "")
                made = Path(sources.get(mount["name"], root / mount["name"])) / sub
                if sub and not made.exists():  # the kubelet makes a missing subPath
                    made.mkdir(parents=True)
                if self.kubelet.isolation == mountns.NAMESPACES:
                    continue
                link = worker.dir / "root" / mount["mountPath"].lstrip("/")
                source = made
                link.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    link.symlink_to(source)
