"""Pod volumes as plain directories: ConfigMap, Secret, downward API and emptyDir.

There is no mount namespace, so a container cannot see a volume at its ``mountPath``. Each
volume is written once at pod start to ``<pod dir>/volumes/<volume name>/`` and linked at
``<pod dir>/root/<mountPath>``; a process finds its files there: a path P inside the
container is ``$ROLLOUTRUN_LOCALCLUSTER_ROOT/P`` on this machine. Later ConfigMap and Secret
changes are not propagated. Volume directories are 0700 and their files 0600 (a Secret's
files must not be readable by other users of the machine; ``defaultMode`` is not emulated).
"""

from __future__ import annotations

import base64
import contextlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

    def materialize(self, worker: PodWorker) -> None:
        pod = self.kubelet.pod(worker.uid)
        if pod is None:
            return
        root = private_dir(worker.dir / "volumes")
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
                link = worker.dir / "root" / mount["mountPath"].lstrip("/")
                source: Path = root / mount["name"] / mount.get("subPath", "")
                link.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    link.symlink_to(source)
