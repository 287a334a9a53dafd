"""Server-side apply, managedFields and OpenAPI v2 against the local cluster, driven by the
real clients: kubectl (``apply --server-side``, conflicts, ``--force-conflicts``, client-side
validation from the v2 document), the Python client, and helm v4 (install, upgrade in
namespaced mode, uninstall of the chart)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import urllib3
import yaml
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from tests.support.kubectl import kubectl_result as _kubectl

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rolloutrun-operator"
CRD_FILE = CHART / "crds" / "rolloutruns.rolloutrun.dev.yaml"
HELM = ROOT / ".tools" / "helm"
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")


def _managed(obj: dict[str, Any]) -> dict[tuple[str, str], Any]:
    """managedFields as {(manager, operation): fieldsV1}."""
    return {(e["manager"], e["operation"]): e["fieldsV1"] for e in obj["metadata"]["managedFields"]}


def _configmap(namespace: str, data: dict[str, str]) -> str:
    manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cfg", "namespace": namespace, "labels": {"app": "demo"}},
        "data": data,
    }
    return json.dumps(manifest)


def _get(cluster: LocalCluster, namespace: str, what: str) -> dict[str, Any]:
    done = _kubectl(cluster, "-n", namespace, "get", what, "-o", "json", "--show-managed-fields")
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@needs_kubectl
def test_kubectl_apply_server_side_conflicts_force_and_removal(
    cluster: LocalCluster, namespace: str
) -> None:
    apply = ("-n", namespace, "apply", "--server-side", "-f", "-")
    done = _kubectl(cluster, *apply, stdin=_configmap(namespace, {"key": "one", "other": "x"}))
    assert done.returncode == 0 and "configmap/cfg serverside-applied" in done.stdout, done.stderr
    cm = _get(cluster, namespace, "configmap/cfg")
    assert _managed(cm) == {
        ("kubectl", "Apply"): {
            "f:data": {"f:key": {}, "f:other": {}},
            "f:metadata": {"f:labels": {"f:app": {}}},
        }
    }
    rv = cm["metadata"]["resourceVersion"]
    again = _kubectl(cluster, *apply, stdin=_configmap(namespace, {"key": "one", "other": "x"}))
    assert again.returncode == 0
    assert _get(cluster, namespace, "configmap/cfg")["metadata"]["resourceVersion"] == rv

    # A second manager changing a field kubectl owns: a conflict, printed as kubectl prints it.
    second = (*apply, "--field-manager=second")
    changed = _configmap(namespace, {"key": "two", "other": "x"})
    refused = _kubectl(cluster, *second, stdin=changed)
    assert refused.returncode == 1
    assert 'Apply failed with 1 conflict: conflict with "kubectl": .data.key' in refused.stderr
    assert "--force-conflicts" in refused.stderr
    forced = _kubectl(cluster, *second, "--force-conflicts", stdin=changed)
    assert forced.returncode == 0, forced.stderr
    cm = _get(cluster, namespace, "configmap/cfg")
    assert cm["data"] == {"key": "two", "other": "x"}
    owners = _managed(cm)
    assert owners[("kubectl", "Apply")]["f:data"] == {"f:other": {}}  # key was taken over
    assert owners[("second", "Apply")]["f:data"] == {"f:key": {}, "f:other": {}}

    # kubectl stops applying `other`: still owned by `second`, so it stays...
    _kubectl(cluster, *apply, stdin=_configmap(namespace, {}))
    assert _get(cluster, namespace, "configmap/cfg")["data"] == {"key": "two", "other": "x"}
    # ...until its last manager stops applying it too.
    _kubectl(cluster, *second, stdin=_configmap(namespace, {"key": "two"}))
    assert _get(cluster, namespace, "configmap/cfg")["data"] == {"key": "two"}


@needs_kubectl
def test_kubectl_moves_a_client_side_applied_object_to_server_side(
    cluster: LocalCluster, namespace: str
) -> None:
    """kubectl rewrites managedFields after its first server-side apply of an object it had
    applied client-side (the server keeps a request's own managedFields); afterwards a new
    value applies without conflicting with ``kubectl-client-side-apply``."""
    args = ("-n", namespace, "apply", "-f", "-")
    assert _kubectl(cluster, *args, stdin=_configmap(namespace, {"key": "one"})).returncode == 0
    first = _kubectl(cluster, *args, "--server-side", stdin=_configmap(namespace, {"key": "one"}))
    assert first.returncode == 0, first.stderr
    managers = {m for m, _ in _managed(_get(cluster, namespace, "configmap/cfg"))}
    assert "kubectl-client-side-apply" not in managers and "kubectl" in managers
    done = _kubectl(cluster, *args, "--server-side", stdin=_configmap(namespace, {"key": "two"}))
    assert done.returncode == 0, done.stderr


@pytest.fixture
def rolloutrun_crd(cluster: LocalCluster) -> None:
    done = _kubectl(cluster, "apply", "--server-side", "-f", str(CRD_FILE))
    assert done.returncode == 0, done.stderr


@needs_kubectl
def test_kubectl_apply_server_side_of_a_rolloutrun(
    cluster: LocalCluster, namespace: str, rolloutrun_crd: None
) -> None:
    run = {
        "apiVersion": "rolloutrun.dev/v1alpha1",
        "kind": "RolloutRun",
        "metadata": {"name": "ssa-run", "namespace": namespace},
        "spec": {"storage": {"uri": "gs://bucket/ssa-run"}, "gym": {"replicas": 2}},
    }
    done = _kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=json.dumps(run))
    assert done.returncode == 0 and "serverside-applied" in done.stdout, done.stderr
    obj = _get(cluster, namespace, "rolloutrun/ssa-run")
    fields = _managed(obj)[("kubectl", "Apply")]
    assert fields["f:spec"]["f:storage"] == {"f:uri": {}}
    assert fields["f:spec"]["f:gym"] == {"f:replicas": {}}
    assert "f:status" not in fields
    # The schema's defaults fill fields no manager applied; a changed value re-applies.
    run["spec"]["gym"]["replicas"] = 3
    done = _kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=json.dumps(run))
    assert done.returncode == 0, done.stderr
    assert _get(cluster, namespace, "rolloutrun/ssa-run")["spec"]["gym"]["replicas"] == 3


@needs_kubectl
def test_kubectl_validates_on_the_client_from_openapi_v2(
    cluster: LocalCluster, namespace: str, rolloutrun_crd: None
) -> None:
    """A ``List`` is validated on the client, from the protobuf v2 document: the CRD's
    schema there makes kubectl name the unknown and the missing field itself."""
    listing = {
        "apiVersion": "v1",
        "kind": "List",
        "items": [
            {
                "apiVersion": "rolloutrun.dev/v1alpha1",
                "kind": "RolloutRun",
                "metadata": {"name": "bad", "namespace": namespace},
                "spec": {"bogusField": 1},
            }
        ],
    }
    done = _kubectl(cluster, "create", "--validate=strict", "-f", "-", stdin=json.dumps(listing))
    assert done.returncode == 1
    assert 'unknown field "bogusField" in dev.rolloutrun.v1alpha1.RolloutRun.spec' in done.stderr
    assert 'missing required field "storage"' in done.stderr


def test_every_write_records_its_manager(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "m"}, "data": {"a": "1"}})
    cm = core.read_namespaced_config_map("m", namespace)
    (entry,) = cm.metadata.managed_fields
    assert (entry.manager, entry.operation) == ("OpenAPI-Generator", "Update")
    assert entry.fields_v1 == {"f:data": {".": {}, "f:a": {}}}
    patched = core.patch_namespaced_config_map(
        "m", namespace, {"data": {"a": "2", "b": "3"}}, field_manager="editor"
    )
    entries = {e.manager: e for e in patched.metadata.managed_fields}
    assert entries["editor"].fields_v1 == {"f:data": {"f:a": {}, "f:b": {}}}
    assert entries["OpenAPI-Generator"].fields_v1 == {"f:data": {}}  # the map itself
    # A write that changes nothing is still no write (managedFields keep their time).
    again = core.patch_namespaced_config_map("m", namespace, {"data": {"a": "2"}})
    assert again.metadata.resource_version == patched.metadata.resource_version


def test_apply_over_http(cluster: LocalCluster, client: Any, namespace: str) -> None:
    """Create by apply (201), ``dryRun``, the required ``fieldManager`` and the 409 Status."""
    core: Any = k8s.CoreV1Api(client)
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))

    def apply(body: dict[str, Any], **query: str) -> tuple[int, dict[str, Any]]:
        path = f"/api/v1/namespaces/{namespace}/configmaps/{body['metadata']['name']}"
        response = http.request(
            "PATCH",
            f"{cluster.api_url}{path}?{urlencode(query)}",
            body=yaml.safe_dump(body).encode(),
            headers={
                "Authorization": f"Bearer {cluster.token}",
                "Content-Type": "application/apply-patch+yaml",
            },
        )
        return response.status, json.loads(response.data)

    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ap"}, "data": {"k": "v"}}
    code, status = apply(body)
    assert code == 422
    assert status["message"] == (
        'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: '
        "is required for apply patch"
    )
    code, _ = apply(body, fieldManager="a", dryRun="All")
    assert code == 201
    assert core.list_namespaced_config_map(namespace, field_selector="metadata.name=ap").items == []
    code, created = apply(body, fieldManager="a")
    assert code == 201 and created["data"] == {"k": "v"}
    code, status = apply({**body, "data": {"k": "w"}}, fieldManager="b")
    assert code == 409 and status["reason"] == "Conflict"
    assert status["message"] == 'Apply failed with 1 conflict: conflict with "a": .data.k'
    assert status["details"]["causes"] == [
        {"reason": "FieldManagerConflict", "message": 'conflict with "a"', "field": ".data.k"}
    ]
    code, taken = apply({**body, "data": {"k": "w"}}, fieldManager="b", force="true")
    assert code == 200 and taken["data"] == {"k": "w"}


# ------------------------------------------------------------------------------ helm
@pytest.fixture
def helm(cluster: LocalCluster, tmp_path: Path) -> Iterator[Any]:
    if not HELM.exists():
        pytest.skip("helm is fetched with `make tools`")
    pytest.importorskip(
        "rolloutrun_localcluster.protobuf",
        reason="helm stores releases through client-go, which sends protobuf bodies",
    )
    env = {
        **os.environ,
        "KUBECONFIG": str(cluster.kubeconfig_path),
        "HELM_CACHE_HOME": str(tmp_path / "cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "config"),
        "HELM_DATA_HOME": str(tmp_path / "data"),
    }

    def run(*args: str) -> str:
        done = subprocess.run(
            [str(HELM), *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    yield run


def _exists(call: Any, *args: Any) -> bool:
    try:
        call(*args)
    except k8s.ApiException as error:
        if error.status == 404:
            return False
        raise
    return True


def test_helm_installs_upgrades_and_uninstalls_the_chart(
    helm: Any, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    apps: Any = k8s.AppsV1Api(client)
    ext: Any = k8s.ApiextensionsV1Api(client)
    release = f"rr{uuid.uuid4().hex[:6]}"
    name = f"{release}-rolloutrun-operator"
    helm("install", release, str(CHART), "--namespace", namespace)

    crd = ext.read_custom_resource_definition("rolloutruns.rolloutrun.dev")
    assert crd.status.conditions[0].type in ("NamesAccepted", "Established")
    deployment = apps.read_namespaced_deployment(name, namespace)
    (owner,) = deployment.metadata.managed_fields
    assert (owner.manager, owner.operation) == ("helm", "Apply")
    containers = owner.fields_v1["f:spec"]["f:template"]["f:spec"]["f:containers"]
    assert '{"name":"operator"}' in "".join(containers)
    assert rbac.read_cluster_role(name).metadata.managed_fields[0].manager == "helm"
    assert rbac.read_cluster_role_binding(name).role_ref.name == name
    assert core.read_namespaced_service_account(name, namespace).metadata.name == name
    releases = core.list_namespaced_secret(namespace, label_selector=f"owner=helm,name={release}")
    assert [s.type for s in releases.items] == ["helm.sh/release.v1"]
    token = core.read_namespaced_secret(f"{name}-metrics-token", namespace).data["token"]
    assert token  # the operator's /metrics bearer token: random, kept by the upgrade below

    # Namespaced mode: a Role + RoleBinding per watched namespace, no cluster-wide grant.
    watched = [f"{namespace}-a", f"{namespace}-b"]
    for ns in watched:
        core.create_namespace({"metadata": {"name": ns}})
    try:
        helm(
            "upgrade", release, str(CHART), "--namespace", namespace,
            "--set", "watchNamespaces={" + ",".join(watched) + "}",
        )  # fmt: skip
        for ns in watched:
            role = rbac.read_namespaced_role(name, ns)
            assert role.metadata.managed_fields[0].manager == "helm"
            assert rbac.read_namespaced_role_binding(name, ns).subjects[0].namespace == namespace
        assert not _exists(rbac.read_cluster_role, name)
        assert not _exists(rbac.read_cluster_role_binding, name)
        assert _exists(rbac.read_cluster_role, f"{name}-nodes")
        args = apps.read_namespaced_deployment(name, namespace).spec.template.spec.containers[0]
        assert any(ns in arg for arg in args.args for ns in watched)
        again = core.read_namespaced_secret(f"{name}-metrics-token", namespace).data["token"]
        assert again == token  # scrapers holding it keep working across upgrades

        helm("uninstall", release, "--namespace", namespace)
        for ns in watched:
            assert not _exists(rbac.read_namespaced_role, name, ns)
        assert not _exists(apps.read_namespaced_deployment, name, namespace)
        assert not _exists(rbac.read_cluster_role, f"{name}-nodes")
        assert not _exists(core.read_namespaced_service_account, name, namespace)
        assert core.list_namespaced_secret(namespace, label_selector="owner=helm").items == []
        # helm keeps what it installed from crds/.
        assert _exists(ext.read_custom_resource_definition, "rolloutruns.rolloutrun.dev")
    finally:
        for ns in watched:
            core.delete_namespace(ns)


#: Kopf's namespaced peering CRD as another Kopf operator installs it (Kopf's docs), unowned.
FOREIGN_PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev", "labels": {"installed-by": "other-operator"}},
    "spec": {
        "scope": "Namespaced",
        "group": "kopf.dev",
        "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "status": {
                                "type": "object",
                                "x-kubernetes-preserve-unknown-fields": True,
                            }
                        },
                    }
                },
            }
        ],
    },
}


def _as_the_chart_runs_it(cluster: LocalCluster, client: Any, release: str, namespace: str) -> Any:
    """The operator's config from the installed Deployment's own arguments, authenticated as
    the chart's ServiceAccount; its 0.0.0.0 endpoints off (nothing here listens but loopback)."""
    from rolloutrun_localcluster import kubeconfig
    from rolloutrun_operator.cli import operator_config
    from rolloutrun_runtime.cli import build_parser

    name = f"{release}-rolloutrun-operator"
    deployment = k8s.AppsV1Api(client).read_namespaced_deployment(name, namespace)
    args = build_parser().parse_args(deployment.spec.template.spec.containers[0].args)
    token = _kubectl(cluster, "-n", namespace, "create", "token", name).stdout.strip()
    path = cluster.directory / f"{release}.kubeconfig"
    ca = cluster.ca_path.read_bytes()
    args.kubeconfig = str(kubeconfig.write(path, cluster.api_url, token, ca, namespace))
    config = operator_config(args)
    config.liveness = None
    config.options.metrics_port = None
    return config


def _handles_a_run(custom: Any, namespace: str) -> None:
    """A suspended run (no pods) reaches Suspended=True and is released on deletion."""
    from rolloutrun_localcluster.testing import eventually

    api = ("rolloutrun.dev", "v1alpha1", namespace, "rolloutruns")
    run = {
        "apiVersion": "rolloutrun.dev/v1alpha1",
        "kind": "RolloutRun",
        "metadata": {"name": "peered", "namespace": namespace},
        "spec": {"storage": {"uri": "gs://bucket/peered"}, "suspend": True},
    }
    custom.create_namespaced_custom_object(*api, run)

    def suspended() -> list[Any]:
        status = custom.get_namespaced_custom_object(*api, "peered").get("status", {})
        conditions = status.get("conditions", [])
        return [c for c in conditions if c["type"] == "Suspended" and c["status"] == "True"]

    def gone() -> bool:
        return not _exists(custom.get_namespaced_custom_object, *api, "peered")

    eventually(suspended, what="the peered operator handling a run")
    custom.delete_namespaced_custom_object(*api, "peered")
    eventually(gone, what="the run's finalizer released")


def test_helm_namespaced_peering_beside_another_kopf_operator(
    cluster: LocalCluster, helm: Any, client: Any, namespace: str, caplog: Any
) -> None:
    """Another Kopf operator installed the peering CRD first: the chart installs (its
    crds/ skip what exists; a CRD in templates/ was refused as owned by no release) and the
    operator, run with the Deployment's own arguments as the chart's ServiceAccount, finds
    its KopfPeering in the watched namespace (its keep-alive lands in the object's status)
    and handles a run there instead of pausing."""
    from rolloutrun_localcluster.testing import eventually
    from rolloutrun_operator.runner import OperatorThread, warn_of_missing_peerings

    ext: Any = k8s.ApiextensionsV1Api(client)
    core: Any = k8s.CoreV1Api(client)
    custom: Any = k8s.CustomObjectsApi(client)
    if not _exists(ext.read_custom_resource_definition, "kopfpeerings.kopf.dev"):
        ext.create_custom_resource_definition(FOREIGN_PEERING_CRD)
    watched = f"{namespace}-team"
    core.create_namespace({"metadata": {"name": watched}})
    peering = ("kopf.dev", "v1", watched, "kopfpeerings", "rolloutrun")
    release = f"p{uuid.uuid4().hex[:6]}"
    try:
        helm(
            "install", release, str(CHART), "--namespace", namespace,
            "--set", f"watchNamespaces={{{watched}}}", "--set", "peering.enabled=true",
        )  # fmt: skip
        labels = custom.get_namespaced_custom_object(*peering)["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == release
        config = _as_the_chart_runs_it(cluster, client, release, namespace)
        assert (config.namespaces, config.peering) == ([watched], "rolloutrun")
        assert asyncio.run(warn_of_missing_peerings(config)) == []
        # a name the chart did not install: said at ERROR, where Kopf pauses at DEBUG
        absent = dataclasses.replace(config, peering="absent")
        with caplog.at_level(logging.ERROR, logger="rolloutrun_operator.runner"):
            assert asyncio.run(warn_of_missing_peerings(absent)) == [
                f"KopfPeering {watched}/absent"
            ]
        assert f"KopfPeering {watched}/absent does not exist: Kopf pauses" in caplog.text

        def keepalive() -> list[Any]:
            status = custom.get_namespaced_custom_object(*peering).get("status", {})
            return [peer for peer in status.values() if peer.get("priority") == 100]

        with OperatorThread(config):
            eventually(keepalive, what="the operator's keep-alive in its KopfPeering")
            _handles_a_run(custom, watched)
        helm("uninstall", release, "--namespace", namespace)
        assert not _exists(custom.get_namespaced_custom_object, *peering)
        assert _exists(ext.read_custom_resource_definition, "kopfpeerings.kopf.dev")
    finally:
        core.delete_namespace(watched)
