"""Small reads and grants the local-cluster tests make through the kubernetes client:
spelled once here so each test says only what it is about."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s


def gone(read: Callable[[], object]) -> bool:
    """Whether what ``read`` reads is no longer there (the read answers 404)."""
    try:
        read()
    except k8s.ApiException as error:
        return error.status == 404
    return False


def pod_gone(core: Any, namespace: str, name: str) -> bool:
    """Whether the pod is no longer there."""
    return gone(lambda: core.read_namespaced_pod(name, namespace))


def pod_in_phase(core: Any, namespace: str, name: str, *phases: str) -> Any:
    """The pod if its phase is one of ``phases``, else None (a check for ``eventually``)."""
    pod = core.read_namespaced_pod(name, namespace)
    return pod if pod.status.phase in phases else None


def grant_pod_listing(core: Any, namespace: str) -> None:
    """Let the namespace's ``default`` ServiceAccount list pods (a pod that lists pods with
    its account's token needs it, as on a real cluster): Role and RoleBinding ``lister``."""
    rbac: Any = k8s.RbacAuthorizationV1Api(core.api_client)
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}
    rbac.create_namespaced_role(namespace, {"metadata": {"name": "lister"}, "rules": [rule]})
    subject = {"kind": "ServiceAccount", "name": "default", "namespace": namespace}
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lister"}
    binding = {"metadata": {"name": "lister"}, "roleRef": ref, "subjects": [subject]}
    rbac.create_namespaced_role_binding(namespace, binding)
