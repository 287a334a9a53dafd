"""Kueue, emulated only as far as the job-controller protocol needs (tests only).

The operator talks to Kueue through ``kueue.x-k8s.io/v1beta1`` Workloads; this module gives
the local cluster that API (the Workload and ResourceFlavor CRDs, trimmed to what the
operator reads and writes) and an :class:`Admitter` that writes a Workload's status the way
Kueue's scheduler does when it admits (``status.admission`` with podSetAssignments,
``QuotaReserved`` and ``Admitted`` True, a previous ``Evicted`` set False) and when it
preempts (``Evicted`` True, the admission left for the job controller to release). No
quota is computed: the test decides when to admit and evict.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta1"
ANY_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def _crd(kind: str, plural: str, scope: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "plural": plural,
                "singular": kind.lower(),
                "listKind": f"{kind}List",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {"spec": ANY_OBJECT, "status": ANY_OBJECT},
                        }
                    },
                }
            ],
        },
    }


WORKLOAD_CRD = _crd("Workload", "workloads", "Namespaced")
RESOURCE_FLAVOR_CRD = _crd("ResourceFlavor", "resourceflavors", "Cluster")
CRDS = [WORKLOAD_CRD, RESOURCE_FLAVOR_CRD]


def _now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _set(
    conditions: list[dict[str, Any]], kind: str, status: bool, reason: str, message: str
) -> None:
    value = "True" if status else "False"
    for condition in conditions:
        if condition.get("type") == kind:
            if condition.get("status") != value:
                condition["lastTransitionTime"] = _now()
            condition.update(status=value, reason=reason, message=message)
            return
    conditions.append(
        {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message,
            "lastTransitionTime": _now(),
        }
    )


class Admitter:
    """Kueue's side of one namespace's Workloads, driven by the test."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client as k8s

        self.objects: Any = k8s.CustomObjectsApi(api)
        self.namespace = namespace

    def flavor(self, name: str, node_labels: dict[str, str]) -> None:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceFlavor",
            "metadata": {"name": name},
            "spec": {"nodeLabels": node_labels},
        }
        self.objects.create_cluster_custom_object(GROUP, VERSION, "resourceflavors", body)

    def workload(self, name: str) -> dict[str, Any] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return dict(
                self.objects.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, "workloads", name
                )
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def condition(self, name: str, kind: str) -> dict[str, Any] | None:
        body = self.workload(name) or {}
        found = [c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == kind]
        return found[0] if found else None

    def _write(self, name: str, status: dict[str, Any]) -> None:
        self.objects.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, "workloads", name, {"status": status}
        )

    def admit(self, name: str, flavor: str) -> None:
        """Reserve quota on ``flavor`` for every podSet and admit (no admission checks)."""
        body = self.workload(name)
        assert body is not None, f"no Workload {name}"
        assignments = [
            {
                "name": pod_set["name"],
                "count": pod_set["count"],
                "flavors": {"cpu": flavor, "memory": flavor},
            }
            for pod_set in body["spec"]["podSets"]
        ]
        conditions = list((body.get("status") or {}).get("conditions") or [])
        message = "Quota reserved in ClusterQueue cluster-queue"
        _set(conditions, "QuotaReserved", True, "QuotaReserved", message)
        _set(conditions, "Admitted", True, "Admitted", "The workload is admitted")
        if any(c["type"] == "Evicted" for c in conditions):
            _set(conditions, "Evicted", False, "QuotaReserved", "Previously: evicted")
        admission = {"clusterQueue": "cluster-queue", "podSetAssignments": assignments}
        self._write(name, {"admission": admission, "conditions": conditions})

    def evict(self, name: str, reason: str, message: str) -> None:
        """Mark the Workload evicted; Kueue waits for the job controller to stop the job
        and release the quota (``status.admission`` unset)."""
        body = self.workload(name)
        assert body is not None, f"no Workload {name}"
        conditions = list((body.get("status") or {}).get("conditions") or [])
        _set(conditions, "Evicted", True, reason, message)
        self._write(name, {"conditions": conditions})

    def released(self, name: str) -> bool:
        body = self.workload(name) or {}
        return bool(body) and not (body.get("status") or {}).get("admission")
