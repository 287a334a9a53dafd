"""Per-kind rules the real API server applies on write, as small strategy classes.

Each built-in kind has its defaults, validation and deletion behaviour in the server (its
"registry strategy"); custom resources follow their CRD's schema. Only the rules a client
can observe and the operator relies on are here: pod defaults and spec immutability, pods'
graceful deletion, Service ``clusterIP`` allocation, Secret ``stringData``, namespace
termination, CRD status, and structural-schema pruning, defaulting and validation.
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

from . import cel, errors, schema, taint_eviction, validation
from .resources import ResourceType

if TYPE_CHECKING:
    from .store import Store

Obj = dict[str, Any]
Cause = tuple[str, str, str]


class Strategy:
    """Defaults: the metadata and spec rules of :mod:`.validation` (names by kind, labels,
    annotations, selectors), immediate deletion unless finalizers hold it."""

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        return []

    def prepare_update(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj,
        subresource: str | None,
        store: Store,
        strict: bool,
    ) -> list[str]:
        return []

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> list[Cause]:
        return validation.object_causes(rtype.storage_key, obj, old)

    def grace_period(self, obj: Obj, options: Obj) -> int | None:
        """Seconds a deletion waits before removal; ``None`` for kinds without grace."""
        return None

    def holds_deletion(self, obj: Obj) -> bool:
        """Whether a controller, not the store, removes the object after deletion starts."""
        return False

    def prepare_delete(self, rtype: ResourceType, obj: Obj) -> None:
        return None


class PodStrategy(Strategy):
    # Fields a pod update may change (everything else in spec is immutable).
    MUTABLE = ("activeDeadlineSeconds", "tolerations", "terminationGracePeriodSeconds")

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        spec = obj.setdefault("spec", {})
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("schedulerName", "default-scheduler")
        spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
        spec.setdefault("serviceAccount", spec["serviceAccountName"])
        tolerations = spec.get("tolerations") or []
        if isinstance(tolerations, list) and all(isinstance(t, dict) for t in tolerations):
            # the DefaultTolerationSeconds admission plugin (see .taint_eviction)
            spec["tolerations"] = taint_eviction.with_default_tolerations(tolerations)
        spec.setdefault("securityContext", {})
        spec.setdefault("enableServiceLinks", True)
        for container in spec.get("initContainers", []) + spec.get("containers", []):
            if isinstance(container, dict):
                container.setdefault("terminationMessagePath", "/dev/termination-log")
                container.setdefault("terminationMessagePolicy", "File")
                container.setdefault("imagePullPolicy", "IfNotPresent")
                container.setdefault("resources", {})
                for port in container.get("ports") or []:
                    if isinstance(port, dict):
                        port.setdefault("protocol", "TCP")
        obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        return []

    def prepare_update(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj,
        subresource: str | None,
        store: Store,
        strict: bool,
    ) -> list[str]:
        return []

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> list[Cause]:
        causes = super().validate(rtype, obj, old)
        spec = obj.get("spec") or {}
        if old is not None:
            if _strip_mutable(spec, self.MUTABLE) != _strip_mutable(
                old.get("spec") or {}, self.MUTABLE
            ):
                message = (
                    "spec: Forbidden: pod updates may not change fields other than "
                    "`spec.containers[*].image`,`spec.initContainers[*].image`,"
                    "`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to "
                    "existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to "
                    "be set to 1 if it was previously negative)"
                )
                causes.append(("FieldValueForbidden", "spec", message))
            return causes
        containers = spec.get("containers")
        if not containers:
            causes.append(
                ("FieldValueRequired", "spec.containers", "spec.containers: Required value")
            )
        for kind in ("initContainers", "containers"):
            for index, container in enumerate(spec.get(kind) or []):
                where = f"spec.{kind}[{index}]"
                if not container.get("image"):
                    causes.append(
                        ("FieldValueRequired", f"{where}.image", f"{where}.image: Required value")
                    )
        policy = spec.get("restartPolicy")
        if policy not in ("Always", "OnFailure", "Never"):
            text = (
                f'spec.restartPolicy: Unsupported value: "{policy}": supported values: '
                '"Always", "OnFailure", "Never"'
            )
            causes.append(("FieldValueNotSupported", "spec.restartPolicy", text))
        return causes

    def grace_period(self, obj: Obj, options: Obj) -> int | None:
        spec = obj.get("spec") or {}
        if options.get("gracePeriodSeconds") is not None:
            grace = int(options["gracePeriodSeconds"])
        else:
            grace = int(spec.get("terminationGracePeriodSeconds", 30))
        phase = (obj.get("status") or {}).get("phase")
        if not spec.get("nodeName") or phase in ("Succeeded", "Failed"):
            return 0
        return max(grace, 0)


def _strip_mutable(spec: Obj, mutable: tuple[str, ...]) -> Obj:
    result = {k: v for k, v in spec.items() if k not in mutable and k != "nodeName"}
    for kind in ("containers", "initContainers"):
        if kind in result:
            result[kind] = [{k: v for k, v in c.items() if k != "image"} for c in result[kind]]
    return result


class ServiceStrategy(Strategy):
    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if spec.get("clusterIP") in (None, ""):
            spec["clusterIP"] = _next_cluster_ip(store, rtype)
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        obj["status"] = {"loadBalancer": {}}
        return []

    def prepare_update(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj,
        subresource: str | None,
        store: Store,
        strict: bool,
    ) -> list[str]:
        spec = obj.setdefault("spec", {})
        old_spec = old.get("spec") or {}
        if not spec.get("clusterIP"):
            spec["clusterIP"] = old_spec.get("clusterIP")
            spec["clusterIPs"] = old_spec.get("clusterIPs")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
        return []


def _next_cluster_ip(store: Store, rtype: ResourceType) -> str:
    """Cluster IPs are recorded, not routed (see docs/local-cluster.md): 10.96.0.0/16."""
    used = {(s.get("spec") or {}).get("clusterIP") for s in store.objects(rtype.storage_key)}
    for index in range(10, 65_000):
        candidate = f"10.96.{index // 256}.{index % 256}"
        if candidate not in used:
            return candidate
    raise errors.ApiError(500, "InternalError", "the cluster IP range is exhausted")


class SecretStrategy(Strategy):
    def _normalize(self, obj: Obj) -> None:
        obj.setdefault("type", "Opaque")
        string_data = obj.pop("stringData", None) or {}
        data = dict(obj.get("data") or {})
        for key, value in string_data.items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        if data or "data" in obj:
            obj["data"] = data

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        self._normalize(obj)
        return []

    def prepare_update(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj,
        subresource: str | None,
        store: Store,
        strict: bool,
    ) -> list[str]:
        self._normalize(obj)
        return []

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> list[Cause]:
        causes = super().validate(rtype, obj, old)
        for key, value in (obj.get("data") or {}).items():
            try:
                base64.b64decode(str(value), validate=True)
            except (binascii.Error, ValueError):
                causes.append(
                    (
                        "FieldValueInvalid",
                        f"data[{key}]",
                        f"data[{key}]: Invalid value: illegal base64 data",
                    )
                )
        return causes


class NamespaceStrategy(Strategy):
    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        labels = obj["metadata"].setdefault("labels", {})
        labels["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
        obj["status"] = {"phase": "Active"}
        return []

    def holds_deletion(self, obj: Obj) -> bool:
        return bool((obj.get("spec") or {}).get("finalizers"))

    def prepare_delete(self, rtype: ResourceType, obj: Obj) -> None:
        obj["status"] = {**(obj.get("status") or {}), "phase": "Terminating"}


class CrdStrategy(Strategy):
    def _status(self, obj: Obj) -> None:
        spec = obj.get("spec") or {}
        conditions = [
            {
                "type": "NamesAccepted",
                "status": "True",
                "reason": "NoConflicts",
                "message": "no conflicts found",
            },
            {
                "type": "Established",
                "status": "True",
                "reason": "InitialNamesAccepted",
                "message": "the initial names have been accepted",
            },
        ]
        stored = [v["name"] for v in spec.get("versions") or [] if v.get("storage")]
        obj["status"] = {
            "conditions": conditions,
            "acceptedNames": spec.get("names") or {},
            "storedVersions": stored,
        }

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        self._status(obj)
        return []

    def prepare_update(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj,
        subresource: str | None,
        store: Store,
        strict: bool,
    ) -> list[str]:
        if subresource is None:
            self._status(obj)
        return []

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> list[Cause]:
        causes = super().validate(rtype, obj, old)
        spec = obj.get("spec") or {}
        names = spec.get("names") or {}
        for field in ("plural", "kind"):
            if not names.get(field):
                causes.append(
                    (
                        "FieldValueRequired",
                        f"spec.names.{field}",
                        f"spec.names.{field}: Required value",
                    )
                )
        if not spec.get("group"):
            causes.append(("FieldValueRequired", "spec.group", "spec.group: Required value"))
        expected = f"{names.get('plural')}.{spec.get('group')}"
        name = obj["metadata"]["name"]
        if names.get("plural") and spec.get("group") and name != expected:
            text = (
                f'metadata.name: Invalid value: "{name}": must be spec.names.plural+"."+spec.group'
            )
            causes.append(("FieldValueInvalid", "metadata.name", text))
        versions = spec.get("versions") or []
        if not versions:
            causes.append(
                (
                    "FieldValueRequired",
                    "spec.versions",
                    "spec.versions: Invalid value: null: must have exactly one version marked "
                    "as storage version",
                )
            )
        elif sum(1 for v in versions if v.get("storage")) != 1:
            causes.append(
                (
                    "FieldValueInvalid",
                    "spec.versions",
                    "spec.versions: Invalid value: must have exactly one version marked as "
                    "storage version",
                )
            )
        return causes


class CustomResourceStrategy(Strategy):
    def _shape(self, rtype: ResourceType, obj: Obj, strict: bool) -> list[str]:
        if rtype.schema is None:
            return []
        pruned, dropped = schema.prune(obj, rtype.schema)
        if dropped and strict:
            unknown = ", ".join(f'unknown field "{path}"' for path in dropped)
            raise errors.bad_request(
                f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: '
                f"strict decoding error: {unknown}"
            )
        obj.clear()
        obj.update(schema.apply_defaults(pruned, rtype.schema))
        return [f'unknown field "{path}"' for path in dropped]

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        return self._shape(rtype, obj, strict)

    def prepare_update(
        self,
        rtype: ResourceType,
        obj: Obj,
        old: Obj,
        subresource: str | None,
        store: Store,
        strict: bool,
    ) -> list[str]:
        return self._shape(rtype, obj, strict)

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> list[Cause]:
        causes = super().validate(rtype, obj, old)
        if rtype.schema is not None:
            body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
            causes += schema.validate(body, rtype.schema)
            if not causes and cel.available():  # the CRD's CEL rules, on the defaulted object
                causes += cel.rule_causes(body, rtype.schema)
        return causes


class RbacStrategy(Strategy):
    """RBAC object names are path segments (``system:discovery``), not DNS subdomains."""

    def validate(self, rtype: ResourceType, obj: Obj, old: Obj | None) -> list[Cause]:
        name = obj["metadata"]["name"]
        why = (
            f"may not be '{name}'"
            if name in (".", "..")
            else next((f"may not contain '{c}'" for c in "/%" if c in name), None)
        )
        if old is not None or why is None:
            return []
        return [
            ("FieldValueInvalid", "metadata.name", f'metadata.name: Invalid value: "{name}": {why}')
        ]


_RBAC = RbacStrategy()


class VolumeStrategy(Strategy):
    """A new claim starts ``Pending`` with the ``kubernetes.io/pvc-protection`` finalizer
    (removed by the provisioner once no pod uses it), a new volume ``Pending`` too (the
    real defaults); the provisioner (storage_provisioner.py) binds them."""

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        obj["status"] = {"phase": "Pending"}
        if rtype.plural == "persistentvolumeclaims":
            finalizers = obj["metadata"].setdefault("finalizers", [])
            if "kubernetes.io/pvc-protection" not in finalizers:
                finalizers.append("kubernetes.io/pvc-protection")
        return []


class DisruptionBudgetStrategy(Strategy):
    """A new budget starts with the zero status (the disruption controller fills it in, and
    an eviction waits until it has observed the budget's generation); its spec rules are
    validation.py's."""

    def prepare_create(
        self, rtype: ResourceType, obj: Obj, store: Store, strict: bool
    ) -> list[str]:
        obj["status"] = {
            "disruptionsAllowed": 0,
            "currentHealthy": 0,
            "desiredHealthy": 0,
            "expectedPods": 0,
        }
        return []


_STRATEGIES: dict[str, Strategy] = {
    **{
        f"{plural}.rbac.authorization.k8s.io": _RBAC
        for plural in ("roles", "clusterroles", "rolebindings", "clusterrolebindings")
    },
    "pods": PodStrategy(),
    "services": ServiceStrategy(),
    "secrets": SecretStrategy(),
    "namespaces": NamespaceStrategy(),
    "customresourcedefinitions.apiextensions.k8s.io": CrdStrategy(),
    "persistentvolumeclaims": VolumeStrategy(),
    "persistentvolumes": VolumeStrategy(),
    "poddisruptionbudgets.policy": DisruptionBudgetStrategy(),
}
_DEFAULT = Strategy()
_CUSTOM = CustomResourceStrategy()


def strategy_for(rtype: ResourceType) -> Strategy:
    if rtype.custom:
        return _CUSTOM
    return _STRATEGIES.get(rtype.storage_key, _DEFAULT)
