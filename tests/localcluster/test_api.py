"""The API server emulator against the real ``kubernetes`` client over HTTP: CRUD,
optimistic concurrency, the three patch formats, finalizers, the status split, selectors,
pagination, CRD schemas and authentication."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually
from tests.support.kopf_operator import CRD, GROUP, PLURAL, VERSION
from tests.support.kube_objects import gone, pod_gone


def _status(error: pytest.ExceptionInfo[k8s.ApiException]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(error.value.body or "{}")
    return body


@pytest.fixture
def crd(widgets: Any) -> Any:
    return widgets


def test_discovery_lists_builtins_and_registers_crds_live(client: Any, crd: Any) -> None:
    assert k8s.VersionApi(client).get_code().major == "1"
    assert k8s.CoreApi(client).get_api_versions().versions == ["v1"]
    core = {r.name for r in k8s.CoreV1Api(client).get_api_resources().resources}
    assert {
        "pods",
        "pods/status",
        "pods/log",
        "services",
        "configmaps",
        "secrets",
        "events",
    } <= core
    assert {"namespaces", "serviceaccounts", "nodes", "endpoints"} <= core
    groups: dict[str, Any] = {g.name: g for g in k8s.ApisApi(client).get_api_versions().groups}
    assert "coordination.k8s.io" in groups
    assert groups[GROUP].preferred_version.version == VERSION
    widgets = k8s.CustomObjectsApi(client).get_api_resources(GROUP, VERSION).resources
    assert {r.name for r in widgets} == {"widgets", "widgets/status"}
    crd_obj: Any = k8s.ApiextensionsV1Api(client).read_custom_resource_definition(
        CRD["metadata"]["name"]
    )
    assert {c.type: c.status for c in crd_obj.status.conditions}["Established"] == "True"


def test_create_stamps_metadata_and_generate_name(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    made = core.create_namespaced_config_map(
        namespace, {"metadata": {"generateName": "cm-"}, "data": {"a": "1"}}
    )
    meta = made.metadata
    assert meta.name.startswith("cm-") and len(meta.name) == len("cm-") + 5
    assert meta.uid and meta.resource_version and meta.generation == 1 and meta.creation_timestamp
    with pytest.raises(k8s.ApiException) as error:
        core.create_namespaced_config_map(namespace, {"metadata": {"name": meta.name}})
    assert error.value.status == 409 and _status(error)["reason"] == "AlreadyExists"
    with pytest.raises(k8s.ApiException) as error:
        core.read_namespaced_config_map("missing", namespace)
    assert error.value.status == 404
    assert _status(error)["message"] == 'configmaps "missing" not found'
    with pytest.raises(k8s.ApiException) as error:
        core.create_namespaced_config_map("no-such-namespace", {"metadata": {"name": "x"}})
    assert error.value.status == 404
    assert _status(error)["message"] == 'namespaces "no-such-namespace" not found'
    with pytest.raises(k8s.ApiException) as error:
        core.create_namespaced_config_map(namespace, {"metadata": {"name": "Not_A_Name"}})
    assert error.value.status == 422 and "RFC 1123" in _status(error)["message"]


def test_put_uses_optimistic_concurrency(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    first = core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "occ"}, "data": {"v": "1"}}
    )
    first.data = {"v": "2"}
    second = core.replace_namespaced_config_map("occ", namespace, first)
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    first.data = {"v": "3"}  # still carries the old resourceVersion
    with pytest.raises(k8s.ApiException) as error:
        core.replace_namespaced_config_map("occ", namespace, first)
    assert error.value.status == 409 and _status(error)["reason"] == "Conflict"
    assert "the object has been modified" in _status(error)["message"]
    # An unchanged write is not a write: same resourceVersion, no event.
    again = core.replace_namespaced_config_map("occ", namespace, second)
    assert again.metadata.resource_version == second.metadata.resource_version


def test_merge_json_and_strategic_patches(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "p", "labels": {"a": "1", "b": "2"}}, "data": {"x": "1"}}
    )
    merged = core.patch_namespaced_config_map(
        "p",
        namespace,
        {"metadata": {"labels": {"a": None, "c": "3"}}},
        _content_type="application/merge-patch+json",
    )
    assert merged.metadata.labels == {"b": "2", "c": "3"}
    ops = [
        {"op": "test", "path": "/data/x", "value": "1"},
        {"op": "replace", "path": "/data/x", "value": "2"},
    ]
    assert core.patch_namespaced_config_map("p", namespace, ops).data == {"x": "2"}
    with pytest.raises(k8s.ApiException) as error:
        core.patch_namespaced_config_map(
            "p", namespace, [{"op": "test", "path": "/data/x", "value": "nope"}]
        )
    assert error.value.status == 422
    # Strategic merge: containers merge by name, so only the named container's image changes.
    pod = {
        "metadata": {"name": "smp"},
        "spec": {
            "nodeName": "elsewhere",  # bound to another node: the kubelet leaves it alone
            "containers": [
                {"name": "a", "image": "one", "command": ["true"]},
                {"name": "b", "image": "two", "command": ["true"]},
            ],
        },
    }
    core.create_namespaced_pod(namespace, pod)
    patched = core.patch_namespaced_pod(
        "smp",
        namespace,
        {"spec": {"containers": [{"name": "b", "image": "three"}]}},
        _content_type="application/strategic-merge-patch+json",
    ).to_dict()
    assert [(c["name"], c["image"]) for c in patched["spec"]["containers"]] == [
        ("a", "one"),
        ("b", "three"),
    ]
    with pytest.raises(k8s.ApiException) as error:
        core.patch_namespaced_pod("smp", namespace, {"spec": {"restartPolicy": "Never"}})
    assert (
        error.value.status == 422
        and "pod updates may not change fields" in _status(error)["message"]
    )
    core.delete_namespaced_pod("smp", namespace, grace_period_seconds=0)


def test_finalizers_hold_deletion(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "fin", "finalizers": ["example.com/hold"]}}
    )
    core.delete_namespaced_config_map("fin", namespace)
    held = core.read_namespaced_config_map("fin", namespace)
    assert held.metadata.deletion_timestamp is not None
    with pytest.raises(k8s.ApiException) as error:
        core.patch_namespaced_config_map(
            "fin", namespace, {"metadata": {"finalizers": ["example.com/hold", "more"]}}
        )
    assert error.value.status == 422 and "no new finalizers" in _status(error)["message"]
    core.patch_namespaced_config_map("fin", namespace, {"metadata": {"finalizers": None}})
    with pytest.raises(k8s.ApiException) as error:
        core.read_namespaced_config_map("fin", namespace)
    assert error.value.status == 404


def test_status_subresource_split_and_generation(client: Any, crd: Any, namespace: str) -> None:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": "g"},
        "spec": {"size": 1},
        "status": {"ignored": True},
    }
    made = crd.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert "status" not in made, "status is dropped on create with a status subresource"
    assert made["spec"]["color"] == "red", "schema defaults apply"
    status = crd.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "g", {"status": {"phase": "Up"}, "spec": {"size": 9}}
    )
    assert status["status"] == {"phase": "Up"} and status["spec"]["size"] == 1
    assert status["metadata"]["generation"] == 1
    spec = crd.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "g", {"spec": {"size": 3}, "status": {"phase": "Down"}}
    )
    assert spec["spec"]["size"] == 3 and spec["status"] == {"phase": "Up"}
    assert spec["metadata"]["generation"] == 2
    labels = crd.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "g", {"metadata": {"labels": {"l": "v"}}}
    )
    assert labels["metadata"]["generation"] == 2


def test_custom_resources_are_validated_against_the_schema(
    client: Any, crd: Any, namespace: str
) -> None:
    def create(spec: Any, **query: Any) -> Any:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "Widget",
            "metadata": {"name": f"v-{uuid.uuid4().hex[:6]}"},
            "spec": spec,
        }
        return crd.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body, **query)

    cases = [
        (
            {"size": 0},
            "spec.size: Invalid value: 0: spec.size in body should be greater than or equal to 1",
        ),
        ({"size": 11}, "spec.size in body should be less than or equal to 10"),
        (
            {"size": "big"},
            'spec.size: Invalid value: "string": '
            'spec.size in body must be of type integer: "string"',
        ),
        (
            {"size": 1, "color": "green"},
            'spec.color: Unsupported value: "green": supported values: "red", "blue"',
        ),
        ({}, "spec.size: Required value"),
        ({"size": 1, "command": [1]}, "spec.command[0]"),
    ]
    for spec, message in cases:
        with pytest.raises(k8s.ApiException) as error:
            create(spec)
        assert error.value.status == 422, spec
        status = _status(error)
        assert status["reason"] == "Invalid" and message in status["message"], status["message"]
        assert status["details"]["causes"], status
    pruned = create({"size": 1, "extra": "x"})
    assert "extra" not in pruned["spec"]
    with pytest.raises(k8s.ApiException) as error:
        create({"size": 1, "extra": "x"}, field_validation="Strict")
    assert error.value.status == 400 and 'unknown field "spec.extra"' in _status(error)["message"]


def test_label_and_field_selectors_and_pagination(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    for index in range(7):
        labels = {"tier": "a" if index % 2 else "b", "i": str(index)}
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": f"s{index}", "labels": labels}}
        )
    names = lambda result: [item.metadata.name for item in result.items]  # noqa: E731
    assert names(core.list_namespaced_config_map(namespace, label_selector="tier=a")) == [
        "s1",
        "s3",
        "s5",
    ]
    assert names(
        core.list_namespaced_config_map(namespace, label_selector="tier!=a,i in (0,2,9)")
    ) == ["s0", "s2"]
    assert names(core.list_namespaced_config_map(namespace, label_selector="!tier")) == [
        n for n in names(core.list_namespaced_config_map(namespace)) if not n.startswith("s")
    ]
    assert names(core.list_namespaced_config_map(namespace, field_selector="metadata.name=s4")) == [
        "s4"
    ]
    with pytest.raises(k8s.ApiException) as error:
        core.list_namespaced_config_map(namespace, field_selector="data.x=1")
    assert error.value.status == 400 and "field label not supported" in _status(error)["message"]
    page = core.list_namespaced_config_map(namespace, label_selector="i", limit=3)
    seen = names(page)
    while page.metadata._continue:
        page = core.list_namespaced_config_map(
            namespace, label_selector="i", limit=3, _continue=page.metadata._continue
        )
        seen += names(page)
    assert seen == [f"s{i}" for i in range(7)]


def test_secret_string_data_and_authentication(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    secret = core.create_namespaced_secret(
        namespace, {"metadata": {"name": "s"}, "stringData": {"k": "v"}}
    )
    assert secret.data == {"k": "dg=="} and secret.type == "Opaque"
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    denied = http.request("GET", f"{cluster.api_url}/api/v1/namespaces")
    assert denied.status == 401 and json.loads(denied.data)["reason"] == "Unauthorized"
    allowed = http.request(
        "GET",
        f"{cluster.api_url}/api/v1/namespaces",
        headers={"Authorization": f"Bearer {cluster.token}"},
    )
    assert allowed.status == 200 and json.loads(allowed.data)["kind"] == "NamespaceList"


def test_leases_and_events_for_the_operator(client: Any, namespace: str) -> None:
    leases: Any = k8s.CoordinationV1Api(client)
    lease = leases.create_namespaced_lease(
        namespace,
        {
            "metadata": {"name": "run-trainer"},
            "spec": {"holderIdentity": "inc-1", "leaseDurationSeconds": 10},
        },
    )
    lease.spec.holder_identity = "inc-2"
    assert (
        leases.replace_namespaced_lease("run-trainer", namespace, lease).spec.holder_identity
        == "inc-2"
    )
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_event(
        namespace,
        {
            "metadata": {"generateName": "e-"},
            "involvedObject": {"kind": "Pod", "name": "x", "namespace": namespace},
            "reason": "Test",
            "type": "Normal",
        },
    )
    found = core.list_namespaced_event(
        namespace, field_selector="involvedObject.kind=Pod,reason=Test"
    )
    assert len(found.items) == 1


def test_the_projects_crd_and_examples_apply(client: Any, namespace: str) -> None:
    """The generated RolloutRun CRD registers, and the shipped examples validate against it."""
    import yaml

    root = Path(__file__).resolve().parents[2]
    crd_file = root / "crds" / "rolloutruns.rolloutrun.dev.yaml"
    if not crd_file.exists():
        pytest.skip("the RolloutRun CRD is not generated yet")
    crd_body = yaml.safe_load(crd_file.read_text())
    ext: Any = k8s.ApiextensionsV1Api(client)
    try:
        ext.create_custom_resource_definition(crd_body)
    except k8s.ApiException as error:
        assert error.status == 409
    group = crd_body["spec"]["group"]
    version = next(v["name"] for v in crd_body["spec"]["versions"] if v.get("storage"))
    plural = crd_body["spec"]["names"]["plural"]
    custom: Any = k8s.CustomObjectsApi(client)
    for example in sorted((root / "examples").glob("*.yaml")):
        body = yaml.safe_load(example.read_text())
        if body.get("kind") != crd_body["spec"]["names"]["kind"]:
            continue
        body["metadata"].pop("namespace", None)
        made = custom.create_namespaced_custom_object(group, version, namespace, plural, body)
        assert made["metadata"]["generation"] == 1 and made["spec"], example.name


def test_edges_of_the_http_surface(
    cluster: LocalCluster, client: Any, crd: Any, namespace: str
) -> None:
    """dryRun, deletecollection, eviction, single-object tables and the error codes of
    unknown paths, wrong methods and unsupported patch types."""
    core: Any = k8s.CoreV1Api(client)
    dry = core.create_namespaced_config_map(namespace, {"metadata": {"name": "dry"}}, dry_run="All")
    assert dry.metadata.uid and gone(lambda: core.read_namespaced_config_map("dry", namespace))
    for index in range(3):
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": f"dc{index}", "labels": {"dc": "y"}}}
        )
    core.delete_collection_namespaced_config_map(namespace, label_selector="dc=y")
    assert core.list_namespaced_config_map(namespace, label_selector="dc=y").items == []
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    auth = {"Authorization": f"Bearer {cluster.token}"}

    def call(
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        accept: str = "",
    ) -> Any:
        headers = {**auth, "Content-Type": content_type}
        if accept:
            headers["Accept"] = accept
        data = None if body is None else json.dumps(body).encode()
        response = http.request(method, f"{cluster.api_url}{path}", body=data, headers=headers)
        return response.status, json.loads(response.data) if response.data else None

    base = f"/api/v1/namespaces/{namespace}"
    assert call("GET", "/api/v1/nosuchthings")[0] == 404
    assert call("PUT", f"{base}/configmaps")[0] == 405
    call("POST", f"{base}/configmaps", {"metadata": {"name": "gone-soon"}})
    code, body = call("DELETE", f"{base}/configmaps/gone-soon")
    assert code == 200 and body["kind"] == "Status" and body["status"] == "Success"
    widget = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"size": 1},
    }
    crd.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, widget)
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/w"
    assert (
        call("PATCH", path, {"spec": {"size": 2}}, "application/strategic-merge-patch+json")[0]
        == 415
    )
    # Server-side apply is served (tests/localcluster/test_apply.py); without a manager: 422.
    code, body = call("PATCH", path, {"spec": {"size": 2}}, "application/apply-patch+yaml")
    assert code == 422 and "fieldManager: Required value" in body["message"]
    code, table = call("GET", path, accept="application/json;as=Table;v=v1;g=meta.k8s.io")
    assert code == 200 and table["kind"] == "Table"
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Size", "Phase"]
    assert table["rows"][0]["cells"][:2] == ["w", 1]
    pod = {
        "metadata": {"name": "evictee"},
        "spec": {
            "containers": [{"name": "c", "image": "x", "command": ["sleep", "60"]}],
            "terminationGracePeriodSeconds": 1,
        },
    }
    core.create_namespaced_pod(namespace, pod)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "evictee"}}
    assert call("POST", f"{base}/pods/evictee/eviction", eviction)[0] == 201
    eventually(lambda: pod_gone(core, namespace, "evictee"), what="evicted pod gone")
