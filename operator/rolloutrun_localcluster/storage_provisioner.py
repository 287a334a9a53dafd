"""PersistentVolumeClaims: a default StorageClass and the provisioner that binds claims.

Why: a pod's own filesystem dies with it (:mod:`.mountns`), so what must outlive a pod
(the run's checkpoints, the Gym's audit) needs a claim, as on a real cluster. The default
StorageClass ``standard`` (provisioner :data:`PROVISIONER`) gets each new claim a new
PersistentVolume backed by a directory under the cluster's ``volumes/`` (every pod that
mounts the claim sees the same files: ReadWriteMany semantics whatever the claim asks),
binds both ways (``claimRef``, ``volumeName``, phase ``Bound``). A deleted claim stays
(``kubernetes.io/pvc-protection``) while a pod that has not ended uses it; once it is
gone, its volume and directory are deleted (``reclaimPolicy: Delete``) or the volume is
marked ``Released`` (``Retain``). A claim with ``storageClassName: ""`` or an unknown
class stays ``Pending``; a pod using a missing or unbound claim is not scheduled, with
the real scheduler's message (:func:`claim_problem`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import errors
from .passes import PassLoop
from .resources import Registry, ResourceType
from .store import Event, Store

logger = logging.getLogger(__name__)

Obj = dict[str, Any]

PROVISIONER = "rolloutrun.dev/local-dir"
DEFAULT_CLASS = "standard"
DEFAULT_CLASS_ANNOTATION = "storageclass.kubernetes.io/is-default-class"
PROTECTION = "kubernetes.io/pvc-protection"
_STORAGE_KEYS = ("persistentvolumeclaims", "persistentvolumes", "storageclasses.storage.k8s.io")


def claim_problem(pod: Obj, find_claim: Callable[[str, str], Obj | None]) -> str | None:
    """Why the scheduler may not place ``pod`` yet because of its claims, or None."""
    namespace = pod["metadata"].get("namespace", "")
    for volume in (pod.get("spec") or {}).get("volumes") or []:
        source = volume.get("persistentVolumeClaim")
        if source is None:
            continue
        name = source.get("claimName", "")
        claim = find_claim(namespace, name)
        if claim is None:
            return f'persistentvolumeclaim "{name}" not found'
        if claim["metadata"].get("deletionTimestamp"):
            return f'persistentvolumeclaim "{name}" is being deleted'
        if (claim.get("status") or {}).get("phase") != "Bound":
            return "pod has unbound immediate PersistentVolumeClaims"
    return None


def scheduler_message(problem: str, nodes: int) -> str:
    """The PodScheduled message the real scheduler writes for a claim problem."""
    return (
        f"0/{nodes} nodes are available: {problem}. preemption: 0/{nodes} nodes are "
        f"available: {nodes} Preemption is not helpful for scheduling."
    )


def volume_for(claim: Obj, storage_class: Obj, directory: Path) -> Obj:
    """The PersistentVolume that provisions ``claim`` in ``directory``."""
    meta, spec = claim["metadata"], claim.get("spec") or {}
    requested = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": volume_name(claim),
            "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": requested},
            "accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
            "persistentVolumeReclaimPolicy": storage_class.get("reclaimPolicy", "Delete"),
            "storageClassName": storage_class["metadata"]["name"],
            "volumeMode": spec.get("volumeMode", "Filesystem"),
            "hostPath": {"path": str(directory), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
        },
    }


def volume_name(claim: Obj) -> str:
    return f"pvc-{claim['metadata']['uid']}"


def default_class() -> Obj:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": DEFAULT_CLASS, "annotations": {DEFAULT_CLASS_ANNOTATION: "true"}},
        "provisioner": PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


class Provisioner:
    """Runs on the cluster's loop: binds new claims, reclaims released volumes."""

    def __init__(self, store: Store, registry: Registry, directory: Path) -> None:
        self.store = store
        self.registry = registry
        self.directory = directory
        self._passes = PassLoop(
            self.reconcile,
            name="localcluster-provisioner",
            failure="volume provisioning pass failed",
            logger=logger,
        )
        store.subscribe(self._on_event)

    def _type(self, group: str, plural: str) -> ResourceType:
        rtype = self.registry.get(group, "v1", plural)
        assert rtype is not None
        return rtype

    def _on_event(self, event: Event) -> None:
        if event.storage_key in _STORAGE_KEYS:
            self._passes.mark_due()
        elif event.storage_key == "pods" and (
            event.type == "DELETED"
            or (event.obj.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        ):
            self._passes.mark_due()  # a claim being deleted may have lost its last user

    def start(self) -> None:
        classes = self._type("storage.k8s.io", "storageclasses")
        if not any(True for _ in self.store.objects(classes.storage_key)):
            self.store.create(classes, "", default_class())
        self._passes.start()

    async def stop(self) -> None:
        await self._passes.stop()

    def _class_of(self, claim: Obj) -> Obj | None:
        classes = self._type("storage.k8s.io", "storageclasses")
        wanted = (claim.get("spec") or {}).get("storageClassName")
        if wanted == "":
            return None  # no dynamic provisioning asked
        for candidate in self.store.objects(classes.storage_key):
            annotations = candidate["metadata"].get("annotations") or {}
            if candidate["metadata"]["name"] == wanted or (
                wanted is None and annotations.get(DEFAULT_CLASS_ANNOTATION) == "true"
            ):
                return candidate if candidate.get("provisioner") == PROVISIONER else None
        return None

    def reconcile(self) -> None:
        """One pass: provision and bind each unbound claim, reclaim orphaned volumes."""
        claims = self._type("", "persistentvolumeclaims")
        for claim in list(self.store.objects(claims.storage_key)):
            meta = claim["metadata"]
            if meta.get("deletionTimestamp"):
                with contextlib.suppress(errors.ApiError):
                    self._release(claim)
                continue
            if (claim.get("spec") or {}).get("volumeName"):
                if (claim.get("status") or {}).get("phase") != "Bound":
                    with contextlib.suppress(errors.ApiError):
                        self._bind_static(claim)
                continue
            storage_class = self._class_of(claim)
            if storage_class is not None:
                with contextlib.suppress(errors.ApiError):
                    self._provision(claim, storage_class)
        self._reclaim()

    def _provision(self, claim: Obj, storage_class: Obj) -> None:
        volumes = self._type("", "persistentvolumes")
        meta = claim["metadata"]
        directory = self.directory / "volumes" / volume_name(claim)
        directory.mkdir(parents=True, exist_ok=True)
        pv = self.store.find(volumes, "", volume_name(claim))
        if pv is None:
            pv = self.store.create(volumes, "", volume_for(claim, storage_class, directory))
        annotations = {
            **(meta.get("annotations") or {}),
            "pv.kubernetes.io/bound-by-controller": "yes",
            "volume.kubernetes.io/storage-provisioner": PROVISIONER,
        }
        claim = {
            **claim,
            "metadata": {**meta, "annotations": annotations},
            "spec": {**claim["spec"], "storageClassName": storage_class["metadata"]["name"]},
        }
        self._mark_bound(claim, pv)

    def _mark_bound(self, claim: Obj, pv: Obj) -> None:
        """Both sides ``Bound``: the volume's status, the claim's volumeName and status."""
        volumes = self._type("", "persistentvolumes")
        claims = self._type("", "persistentvolumeclaims")
        meta = claim["metadata"]
        self.store.update(
            volumes,
            "",
            pv["metadata"]["name"],
            {**pv, "status": {"phase": "Bound"}},
            subresource="status",
        )
        spec = {**claim["spec"], "volumeName": pv["metadata"]["name"]}
        annotations = {**(meta.get("annotations") or {}), "pv.kubernetes.io/bind-completed": "yes"}
        updated = self.store.update(
            claims,
            meta["namespace"],
            meta["name"],
            {**claim, "metadata": {**meta, "annotations": annotations}, "spec": spec},
        )
        status = {
            "phase": "Bound",
            "accessModes": pv["spec"]["accessModes"],
            "capacity": pv["spec"]["capacity"],
        }
        self.store.update(
            claims,
            meta["namespace"],
            meta["name"],
            {**updated, "status": status},
            subresource="status",
        )
        logger.info(
            "bound claim %s/%s to %s", meta["namespace"], meta["name"], pv["metadata"]["name"]
        )

    def _bind_static(self, claim: Obj) -> None:
        """Bind a claim that names its volume (``spec.volumeName``: static provisioning)
        when that volume exists and is free or already reserved for it."""
        volumes = self._type("", "persistentvolumes")
        meta = claim["metadata"]
        pv = self.store.find(volumes, "", claim["spec"]["volumeName"])
        if pv is None:
            return
        ref = pv["spec"].get("claimRef") or {}
        if ref and (ref.get("namespace"), ref.get("name")) != (meta["namespace"], meta["name"]):
            return
        if ref.get("uid") not in (None, meta["uid"]):
            return
        claim_ref = {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "namespace": meta["namespace"],
            "name": meta["name"],
            "uid": meta["uid"],
        }
        pv = self.store.update(
            volumes,
            "",
            pv["metadata"]["name"],
            {**pv, "spec": {**pv["spec"], "claimRef": claim_ref}},
        )
        self._mark_bound(claim, pv)

    def _release(self, claim: Obj) -> None:
        """Drop the claim's protection once no running pod uses it (the real
        pvc-protection controller); the store then removes it."""
        meta = claim["metadata"]
        if PROTECTION not in (meta.get("finalizers") or []):
            return
        for pod in self.store.objects("pods"):
            if pod["metadata"].get("namespace") != meta["namespace"]:
                continue
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            for volume in (pod.get("spec") or {}).get("volumes") or []:
                if (volume.get("persistentVolumeClaim") or {}).get("claimName") == meta["name"]:
                    return
        finalizers = [f for f in meta["finalizers"] if f != PROTECTION]
        claims = self._type("", "persistentvolumeclaims")
        self.store.update(
            claims,
            meta["namespace"],
            meta["name"],
            {**claim, "metadata": {**meta, "finalizers": finalizers}},
        )

    def _reclaim(self) -> None:
        volumes = self._type("", "persistentvolumes")
        claims = self._type("", "persistentvolumeclaims")
        for pv in list(self.store.objects(volumes.storage_key)):
            ref = (pv.get("spec") or {}).get("claimRef") or {}
            if not ref or (pv.get("status") or {}).get("phase") == "Released":
                continue
            claim = self.store.find(claims, ref.get("namespace", ""), ref.get("name", ""))
            if claim is not None and claim["metadata"]["uid"] == ref.get("uid"):
                continue
            name = pv["metadata"]["name"]
            with contextlib.suppress(errors.ApiError):
                if pv["spec"].get("persistentVolumeReclaimPolicy", "Delete") == "Delete":
                    self.store.delete(volumes, "", name)
                    path = (pv["spec"].get("hostPath") or {}).get("path")
                    if path and Path(path).is_relative_to(self.directory / "volumes"):
                        shutil.rmtree(path, ignore_errors=True)
                else:
                    self.store.update(
                        volumes,
                        "",
                        name,
                        {**pv, "status": {"phase": "Released"}},
                        subresource="status",
                    )


def run_claim_name(run: str) -> str:
    """The claim ``rolloutrun run`` keeps a run's storage on."""
    return f"{run}-storage"


def static_claim(run: str, namespace: str, directory: Path) -> tuple[Obj, Obj]:
    """A PersistentVolume on ``directory`` (``Retain``: the user's checkpoints stay after
    the run) and the claim bound to it by name, for ``rolloutrun run``: the run's storage
    is a claim as on a real cluster, and its files are where the user looks for them."""
    name = run_claim_name(run)
    volume = f"{namespace}-{name}"
    pv: Obj = {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": volume},
        "spec": {
            "capacity": {"storage": "10Gi"},
            "accessModes": ["ReadWriteMany"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "",
            "hostPath": {"path": str(directory), "type": "DirectoryOrCreate"},
        },
    }
    claim: Obj = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": "",
            "volumeName": volume,
            "resources": {"requests": {"storage": "10Gi"}},
        },
    }
    return pv, claim
