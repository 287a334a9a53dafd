"""The everyday kubectl commands against the local cluster, run with the real kubectl: the
imperative ``create`` family (kubectl sends those objects as protobuf), ``get`` with the
printer columns a real server fills, ``--sort-by``, ``describe`` and ``events``."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from tests.support.kubectl import kubectl as run_kubectl

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")

Kubectl = Callable[..., str]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kubectl(cluster: LocalCluster, namespace: str) -> Kubectl:
    def run(*args: str, stdin: str | None = None) -> str:
        return run_kubectl(cluster, *args, stdin=stdin, namespace=namespace)

    return run


def test_kubectl_create_makes_the_built_in_kinds(
    kubectl: Kubectl, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    team = f"{namespace}-team"
    assert kubectl("create", "namespace", team) == f"namespace/{team} created\n"
    core.delete_namespace(team)
    kubectl("create", "configmap", "settings", "--from-literal=mode=fast", "--from-literal=x=")
    assert core.read_namespaced_config_map("settings", namespace).data == {"mode": "fast", "x": ""}
    kubectl("create", "secret", "generic", "storage", "--from-literal=key=s3cr\u00e9t")
    secret = core.read_namespaced_secret("storage", namespace)
    assert secret.type == "Opaque"
    assert base64.b64decode(secret.data["key"]).decode() == "s3cr\u00e9t"
    kubectl("create", "serviceaccount", "trainer")
    assert core.read_namespaced_service_account("trainer", namespace).metadata.name == "trainer"
    kubectl("create", "service", "clusterip", "web", "--tcp=80:8080")
    service = core.read_namespaced_service("web", namespace)
    assert service.spec.type == "ClusterIP" and service.spec.selector == {"app": "web"}
    port = service.spec.ports[0]
    assert (port.port, port.target_port, port.protocol) == (80, 8080, "TCP")
    kubectl("create", "role", "reader", "--verb=get,list", "--resource=pods")
    rule = rbac.read_namespaced_role("reader", namespace).rules[0]
    assert (rule.verbs, rule.resources, rule.api_groups) == (["get", "list"], ["pods"], [""])
    kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=reader",
        f"--serviceaccount={namespace}:trainer",
    )
    binding = rbac.read_namespaced_role_binding("reader", namespace)
    assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", "reader")
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", "trainer", namespace)
    ]
    resources = json.loads(kubectl("get", "--raw", "/api/v1"))["resources"]
    if any(r["name"] == "serviceaccounts/token" for r in resources):
        assert kubectl("create", "token", "trainer").count(".") == 2  # a JWT


def table(text: str) -> list[dict[str, str]]:
    """kubectl's printed table as rows of header -> cell. Cells start under their header (an
    empty cell stays empty instead of shifting the next one left); headers hold single spaces
    only (LAST SEEN), columns are at least two apart."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "kubectl printed no table"
    header = lines[0]
    starts = [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 2 : i] == "  ")]
    ends = [*starts[1:], None]
    names = [header[a:b].strip() for a, b in zip(starts, ends, strict=True)]
    return [
        {n: line[a:b].strip() for n, a, b in zip(names, starts, ends, strict=True)}
        for line in lines[1:]
    ]


RR = "rolloutruns.rolloutrun.dev"


@pytest.fixture(scope="module")
def rolloutrun_crd(client: Any) -> None:
    crd = yaml.safe_load((ROOT / "crds" / f"{RR}.yaml").read_text())
    try:
        k8s.ApiextensionsV1Api(client).create_custom_resource_definition(crd)
    except k8s.ApiException as error:
        if error.status != 409:
            raise


def test_kubectl_get_rr_fills_ready_and_reason(
    kubectl: Kubectl, client: Any, namespace: str, rolloutrun_crd: None
) -> None:
    runs: Any = k8s.CustomObjectsApi(client)
    run = {
        "apiVersion": "rolloutrun.dev/v1alpha1",
        "kind": "RolloutRun",
        "metadata": {"name": "demo"},
        "spec": {"storage": {"uri": "gs://bucket/demo"}},
    }
    runs.create_namespaced_custom_object(
        "rolloutrun.dev", "v1alpha1", namespace, "rolloutruns", run
    )
    [row] = table(kubectl("get", "rr"))
    assert list(row) == [
        "NAME",
        "STEP",
        "REWARD",
        "RESTARTS",
        "SNAPSHOT-AGE",
        "READY",
        "REASON",
        "AGE",
    ]
    assert (row["NAME"], row["READY"], row["REASON"]) == ("demo", "", "")

    def set_status(step: int, *conditions: tuple[str, str, str]) -> None:
        status = {
            "trainStep": step,
            "conditions": [{"type": t, "status": s, "reason": r} for t, s, r in conditions],
        }
        runs.patch_namespaced_custom_object_status(
            "rolloutrun.dev", "v1alpha1", namespace, "rolloutruns", "demo", {"status": status}
        )

    set_status(0, ("Progressing", "True", "Training"), ("Ready", "False", "StartingGyms"))
    [row] = table(kubectl("get", "rr"))
    assert (row["STEP"], row["READY"], row["REASON"]) == ("0", "False", "StartingGyms")
    set_status(3, ("Ready", "True", "Running"), ("Progressing", "True", "Training"))
    [row] = table(kubectl("get", "rolloutrun", "demo", "-o", "wide"))
    assert (row["STEP"], row["READY"], row["REASON"]) == ("3", "True", "Running")
    assert "INCARNATION" in row and "PREEMPTIONS" in row and "ANCHOR" in row


def event(
    name: str, involved: dict[str, str], reason: str, minutes_ago: int, kind: str = "Normal"
) -> dict[str, Any]:
    last = datetime.now(UTC) - timedelta(minutes=minutes_ago)
    first = last - timedelta(minutes=30)
    return {
        "metadata": {"name": name},
        "involvedObject": involved,
        "reason": reason,
        "message": f"{reason} happened ",
        "type": kind,
        "source": {"component": "rolloutrun-operator", "host": "local"},
        "firstTimestamp": first.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lastTimestamp": last.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "count": 2,
    }


def make_events(kubectl: Kubectl, core: Any, namespace: str) -> None:
    """Three events about one ConfigMap, created in name order, not time order."""
    kubectl("create", "configmap", "subject")
    uid = core.read_namespaced_config_map("subject", namespace).metadata.uid
    involved = {"kind": "ConfigMap", "name": "subject", "namespace": namespace, "uid": uid}
    for name, reason, minutes_ago in (
        ("e-a", "Second", 20),
        ("e-b", "First", 90),
        ("e-c", "Third", 12),
    ):
        core.create_namespaced_event(namespace, event(name, involved, reason, minutes_ago))


def test_kubectl_get_events_prints_their_columns(
    kubectl: Kubectl, client: Any, namespace: str
) -> None:
    make_events(kubectl, k8s.CoreV1Api(client), namespace)
    rows = table(kubectl("get", "events"))
    assert list(rows[0]) == ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert [(r["LAST SEEN"], r["REASON"], r["OBJECT"]) for r in rows] == [
        ("20m", "Second", "configmap/subject"),
        ("90m", "First", "configmap/subject"),
        ("12m", "Third", "configmap/subject"),
    ]
    assert {(r["TYPE"], r["MESSAGE"]) for r in rows} == {
        ("Normal", f"{reason} happened") for reason in ("First", "Second", "Third")
    }
    wide = table(kubectl("get", "events", "-o", "wide"))
    first = wide[0]
    assert (first["SOURCE"], first["COUNT"], first["NAME"], first["FIRST SEEN"]) == (
        "rolloutrun-operator, local",
        "2",
        "e-a",
        "50m",
    )
    assert [r["REASON"] for r in table(kubectl("events"))] == ["First", "Second", "Third"]


def test_kubectl_get_sort_by_a_field_outside_metadata(
    kubectl: Kubectl, client: Any, namespace: str
) -> None:
    """--sort-by asks for includeObject=Object and sorts the rows by the objects."""
    make_events(kubectl, k8s.CoreV1Api(client), namespace)
    by_time = table(kubectl("get", "events", "--sort-by=.lastTimestamp"))
    assert [r["REASON"] for r in by_time] == ["First", "Second", "Third"]
    kubectl("run", "first", "--image=busybox", "--restart=Never", "--command", "--", "true")
    kubectl("run", "second", "--image=busybox", "--restart=Never", "--command", "--", "echo")
    pods = table(kubectl("get", "pods", "--sort-by=.spec.containers[0].command[0]", "-o", "wide"))
    assert [(r["NAME"], r["NODE"]) for r in pods] == [("second", "local"), ("first", "local")]


def events_section(text: str) -> list[dict[str, str]]:
    """The ``Events:`` table at the end of ``kubectl describe``."""
    _, _, section = text.partition("\nEvents:")
    assert section.strip() and "<none>" not in section.splitlines()[0], text
    lines = [line[2:] for line in section.splitlines()[1:] if line.strip()]
    return [row for row in table("\n".join(lines)) if not row["Type"].startswith("-")]


def test_kubectl_describe_shows_the_events_of_a_pod_a_run_and_a_node(
    kubectl: Kubectl, client: Any, namespace: str, rolloutrun_crd: None
) -> None:
    core: Any = k8s.CoreV1Api(client)
    runs: Any = k8s.CustomObjectsApi(client)
    kubectl("run", "describer", "--image=busybox", "--restart=Never", "--command", "--", "true")
    pod = core.read_namespaced_pod("describer", namespace).metadata
    run = {
        "apiVersion": "rolloutrun.dev/v1alpha1",
        "kind": "RolloutRun",
        "metadata": {"name": "described"},
        "spec": {"storage": {"uri": "gs://bucket/described"}},
    }
    created = runs.create_namespaced_custom_object(
        "rolloutrun.dev", "v1alpha1", namespace, "rolloutruns", run
    )
    node = core.read_node("local").metadata
    subjects = {
        "pod/describer": {
            "kind": "Pod",
            "name": "describer",
            "namespace": namespace,
            "uid": pod.uid,
        },
        "rolloutrun/described": {
            "kind": "RolloutRun",
            "apiVersion": "rolloutrun.dev/v1alpha1",
            "name": "described",
            "namespace": namespace,
            "uid": created["metadata"]["uid"],
        },
        "node/local": {"kind": "Node", "name": "local", "uid": node.uid},
    }
    for i, involved in enumerate(subjects.values()):
        body = event(f"{namespace}-describe-{i}", involved, f"Reason{i}", 15, "Warning")
        core.create_namespaced_event(namespace, body)
    for i, target in enumerate(subjects):
        [row] = events_section(kubectl("describe", target))
        expected = ("Warning", f"Reason{i}", "rolloutrun-operator")
        assert (row["Type"], row["Reason"], row["From"]) == expected
        assert row["Message"] == f"Reason{i} happened" and row["Age"].startswith("15m")
    node_text = kubectl("describe", "node", "local")
    assert "memory:" in node_text and "(-" not in node_text  # percentages of real capacity
    everything = table(kubectl("events", "--types=Warning"))
    assert {r["OBJECT"] for r in everything} >= {"Pod/describer", "RolloutRun/described"}


def test_kubectl_get_all_and_drain(kubectl: Kubectl, namespace: str) -> None:
    """``get all`` reads the ``all`` category; ``drain`` evicts (it looks for ``pods/eviction``
    of policy/v1 in discovery), or with --disable-eviction deletes with protobuf options.
    Only this test's pods match the selectors (other tests' pods stay put)."""
    sleep = ("--image=x", "--command", "--", "sleep", "60")
    kubectl("run", "evictee", f"--labels={namespace}=evict", *sleep)
    kubectl("run", "deletee", f"--labels={namespace}=delete", *sleep)
    kubectl("create", "service", "clusterip", "web", "--tcp=80")
    kubectl("create", "deployment", "web", "--image=x")  # stored; no controller runs it
    listed = kubectl("get", "all", "-o", "name").split()
    assert listed == ["pod/deletee", "pod/evictee", "service/web", "deployment.apps/web"]
    [deployment] = table(kubectl("get", "deployments", "-o", "wide"))
    assert (deployment["READY"], deployment["UP-TO-DATE"], deployment["IMAGES"]) == (
        "0/1",
        "0",
        "x",
    )
    drain = ("drain", "local", "--force", "--grace-period=1", "--timeout=60s")
    try:
        assert "pod/evictee evicted" in kubectl(*drain, f"--pod-selector={namespace}=evict")
        deleted = kubectl(*drain, f"--pod-selector={namespace}=delete", "--disable-eviction")
        assert "pod/deletee deleted" in deleted
    finally:
        kubectl("uncordon", "local")
    assert kubectl("get", "pods", "-o", "name") == ""


def test_a_table_watch_sends_one_row_tables_with_the_columns_once(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    """``kubectl get -w`` watches with the Table Accept header: each event is a one-row Table
    and only the first carries the column definitions, as the real server sends them."""
    core: Any = k8s.CoreV1Api(client)
    mine = {"test": "table-watch"}  # not the namespace's kube-root-ca.crt
    body = {"metadata": {"name": "a", "labels": mine}, "data": {"k": "v"}}
    core.create_namespaced_config_map(namespace, body)
    since = core.list_namespaced_config_map(namespace).metadata.resource_version
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "b", "labels": mine}})
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    headers = {
        "Authorization": f"Bearer {cluster.token}",
        "Accept": "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
    }
    base = f"{cluster.api_url}/api/v1/namespaces/{namespace}/configmaps?watch=true"
    base += "&labelSelector=test%3Dtable-watch"
    for query, names in (("", ["a", "b"]), (f"&resourceVersion={since}", ["b"])):
        url = f"{base}&timeoutSeconds=1&includeObject=Object{query}"
        events = [
            json.loads(line) for line in http.request("GET", url, headers=headers).data.splitlines()
        ]
        tables = [e["object"] for e in events]
        assert [e["type"] for e in events] == ["ADDED"] * len(names)
        assert [t["kind"] for t in tables] == ["Table"] * len(names)
        assert [c["name"] for c in tables[0]["columnDefinitions"]] == ["Name", "Data", "Age"]
        assert all(t["columnDefinitions"] is None for t in tables[1:])
        assert [t["rows"][0]["cells"][0] for t in tables] == names
        assert tables[0]["rows"][0]["object"]["kind"] == "ConfigMap"
    bad = http.request("GET", f"{base}&includeObject=All", headers=headers)
    assert bad.status == 400 and "includeObject" in json.loads(bad.data)["message"]
