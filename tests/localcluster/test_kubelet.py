"""The process kubelet: pods are real processes with the pod's environment, their own
loopback IP, logs, restarts, graceful deletion that kills every process they started, and
a node loss that looks like one to an operator."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.mountns import LOOPBACK, NAMESPACES, namespaces_permitted
from rolloutrun_localcluster.testing import api_client, eventually, local_cluster
from tests.support.kube_objects import grant_pod_listing
from tests.support.kube_objects import pod_gone as _gone
from tests.support.kube_objects import pod_in_phase as _phase

PY = sys.executable
MODES = [NAMESPACES, LOOPBACK] if namespaces_permitted() else [LOOPBACK]


@pytest.fixture(scope="module", params=MODES)
def cluster(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """This module's own cluster, once per isolation mode: every kubelet behaviour holds
    with a mount namespace per pod and in the loopback fallback."""
    directory = tmp_path_factory.mktemp(f"kubelet-{request.param}")
    yield from local_cluster(
        directory, restart_backoff=(0.2, 2.0), bookmark_interval=0.5, isolation=request.param
    )


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Any:
    api = api_client(cluster)
    yield api
    api.close()


def _pod(
    name: str, command: list[str], policy: str = "Never", grace: int = 30, **container: Any
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "restartPolicy": policy,
            "terminationGracePeriodSeconds": grace,
            "containers": [
                {"name": "main", "image": "ignored:latest", "command": command, **container}
            ],
        },
    }


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


SHOW_ENV = """
import json, os
from kubernetes import client, config
config.load_kube_config()  # KUBECONFIG is set for every pod
names = [p.metadata.name for p in client.CoreV1Api().list_namespaced_pod(os.environ["NS"]).items]
keys = ["LIT", "FROM_CM", "FROM_SECRET", "NAME", "NS", "UID", "IP", "POD_IP", "EXPANDED", "P_k"]
keys.append("HOSTNAME")
print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "pods": names, "cwd": os.getcwd()}))
"""


def test_pod_environment_downward_api_and_api_access(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "cm"}, "data": {"k": "from-configmap"}}
    )
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "sec"}, "stringData": {"k": "from-secret"}}
    )
    # The pod lists pods with its account's token: RBAC must grant it, as on a real cluster.
    grant_pod_listing(core, namespace)
    env = [
        {"name": "LIT", "value": "literal"},
        {"name": "FROM_CM", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
        {"name": "FROM_SECRET", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "k"}}},
        {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "EXPANDED", "value": "$(LIT)-and-$(NAME)-$$(LIT)"},
    ]
    pod = _pod(
        "env",
        [PY, "-c", SHOW_ENV],
        env=env,
        envFrom=[{"configMapRef": {"name": "cm"}, "prefix": "P_"}],
    )
    created = core.create_namespaced_pod(namespace, pod)
    done = eventually(
        lambda: _phase(core, namespace, "env", "Succeeded", "Failed"), what="env pod done"
    )
    log = core.read_namespaced_pod_log("env", namespace)
    assert done.status.phase == "Succeeded", log
    report = json.loads(log.strip().splitlines()[-1])
    ip = done.status.pod_ip
    assert ip and ip != "127.0.0.1"  # its own: 127.X.N.M (loopback) or 10.X.N.M (namespaces)
    assert report["env"] == {
        "LIT": "literal",
        "FROM_CM": "from-configmap",
        "FROM_SECRET": "from-secret",
        "NAME": "env",
        "NS": namespace,
        "UID": created.metadata.uid,
        "IP": ip,
        "POD_IP": ip,
        "EXPANDED": "literal-and-env-$(LIT)",
        "P_k": "from-configmap",
        "HOSTNAME": "env",
    }
    assert report["pods"] == ["env"]
    status = done.status.container_statuses[0]
    assert status.state.terminated.exit_code == 0 and status.state.terminated.reason == "Completed"
    assert {c.type: c.status for c in done.status.conditions}["PodScheduled"] == "True"
    assert done.spec.node_name == "local"


SERVE = """
import http.server, os
handler = http.server.SimpleHTTPRequestHandler
http.server.HTTPServer((os.environ["POD_IP"], 8080), handler).serve_forever()
"""
FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).status)"


def test_pods_reach_each_other_by_pod_ip_and_services_list_ready_ones(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    probe = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    server = _pod(
        "server",
        [PY, "-c", SERVE],
        policy="Always",
        grace=1,
        readinessProbe=probe,
        ports=[{"name": "http", "containerPort": 8080}],
    )
    core.create_namespaced_pod(namespace, server)
    core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "server"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
    )
    ready = eventually(lambda: _ready(core, namespace, "server"), what="server ready")
    endpoints = eventually(lambda: _addresses(core, namespace, "web"), what="service endpoints")
    assert endpoints == ([ready.status.pod_ip], [8080])
    assert core.read_namespaced_service("web", namespace).spec.cluster_ip.startswith("10.96.")
    url = f"http://{endpoints[0][0]}:{endpoints[1][0]}/"
    core.create_namespaced_pod(namespace, _pod("fetch", [PY, "-c", FETCH, url]))
    done = eventually(
        lambda: _phase(core, namespace, "fetch", "Succeeded", "Failed"), what="fetch done"
    )
    assert (
        done.status.phase == "Succeeded"
        and core.read_namespaced_pod_log("fetch", namespace).strip() == "200"
    )


def _ready(core: Any, namespace: str, name: str) -> Any:
    pod = core.read_namespaced_pod(name, namespace)
    conditions = {c.type: c.status for c in pod.status.conditions or []}
    return pod if conditions.get("Ready") == "True" else None


def _addresses(core: Any, namespace: str, name: str) -> Any:
    try:
        endpoints = core.read_namespaced_endpoints(name, namespace)
    except k8s.ApiException:
        return None
    for subset in endpoints.subsets or []:
        if subset.addresses:
            return [a.ip for a in subset.addresses], [p.port for p in subset.ports]
    return None


TERM_AWARE = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: (print("got TERM", flush=True), sys.exit(0)))
print("up", flush=True)
time.sleep(300)
"""


def test_deleting_a_pod_terms_then_kills_every_process_it_started(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    # Ignores SIGTERM; starts a child and a grandchild that escapes into its own session.
    stubborn = ["sh", "-c", "trap '' TERM; sleep 300 & setsid sleep 301 & echo started; wait"]
    core.create_namespaced_pod(namespace, _pod("stubborn", stubborn, grace=1))
    core.create_namespaced_pod(namespace, _pod("polite", [PY, "-c", TERM_AWARE], grace=30))
    eventually(lambda: _phase(core, namespace, "stubborn", "Running"), what="stubborn running")
    eventually(lambda: "up" in core.read_namespaced_pod_log("polite", namespace), what="polite up")
    pids = eventually(
        lambda: (lambda p: p if len(p) >= 3 else None)(cluster.pod_pids(namespace, "stubborn")),
        what="3 processes",
    )
    polite_dir = cluster.pod_dir(namespace, "polite")
    assert polite_dir is not None
    core.delete_namespaced_pod("stubborn", namespace)
    terminating = core.read_namespaced_pod("stubborn", namespace)
    assert (
        terminating.metadata.deletion_timestamp is not None
        and terminating.metadata.deletion_grace_period_seconds == 1
    )
    eventually(lambda: _gone(core, namespace, "stubborn"), what="stubborn gone")
    assert not [pid for pid in pids if _alive(pid)], "a process outlived its pod"
    core.delete_namespaced_pod("polite", namespace)
    eventually(lambda: _gone(core, namespace, "polite"), what="polite gone")
    assert (polite_dir / "logs" / "main.log").read_text().splitlines() == ["up", "got TERM"]


def test_restart_policies_back_off_and_previous_logs(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_pod(
        namespace, _pod("flaky", ["sh", "-c", "echo run; exit 3"], policy="OnFailure", grace=0)
    )
    core.create_namespaced_pod(namespace, _pod("once", ["sh", "-c", "exit 0"], policy="OnFailure"))
    core.create_namespaced_pod(namespace, _pod("never", ["sh", "-c", "exit 5"], policy="Never"))
    flaky = eventually(
        lambda: (
            lambda p: (
                p
                if p.status.container_statuses and p.status.container_statuses[0].restart_count >= 2
                else None
            )
        )(core.read_namespaced_pod("flaky", namespace)),
        what="two restarts",
    )
    status = flaky.status.container_statuses[0]
    assert status.last_state.terminated.exit_code == 3 and flaky.status.phase == "Running"
    assert core.read_namespaced_pod_log("flaky", namespace, previous=True) == "run\n"
    assert eventually(lambda: _phase(core, namespace, "once", "Succeeded"), what="once succeeded")
    never = eventually(lambda: _phase(core, namespace, "never", "Failed"), what="never failed")
    terminated = never.status.container_statuses[0].state.terminated
    assert (
        terminated.exit_code,
        terminated.reason,
        never.status.container_statuses[0].restart_count,
    ) == (5, "Error", 0)


def test_config_errors_and_missing_executables(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    env = [{"name": "LATE", "valueFrom": {"configMapKeyRef": {"name": "late", "key": "k"}}}]
    core.create_namespaced_pod(namespace, _pod("waits", ["sh", "-c", "echo $LATE"], env=env))
    core.create_namespaced_pod(namespace, _pod("nobin", ["no-such-binary-anywhere"]))

    def waiting() -> Any:
        statuses = core.read_namespaced_pod("waits", namespace).status.container_statuses or []
        return (
            statuses
            and statuses[0].state.waiting
            and statuses[0].state.waiting.reason == "CreateContainerConfigError"
            and statuses[0].state.waiting
        )

    assert eventually(waiting, what="config error").message == 'configmap "late" not found'
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "late"}, "data": {"k": "arrived"}}
    )
    eventually(lambda: _phase(core, namespace, "waits", "Succeeded"), what="config arrived")
    assert core.read_namespaced_pod_log("waits", namespace) == "arrived\n"
    nobin = eventually(lambda: _phase(core, namespace, "nobin", "Failed"), what="StartError")
    terminated = nobin.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (128, "StartError")
    assert "executable file not found in $PATH" in terminated.message


def test_a_failed_container_reports_the_end_of_its_log_as_its_termination_message(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    script = "echo restoring; echo 'refused: config changed'; exit 78"
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    core.create_namespaced_pod(namespace, _pod("unrestorable", ["sh", "-c", script], **fallback))
    failed = eventually(
        lambda: _phase(core, namespace, "unrestorable", "Failed"), what="exit 78 reported"
    )
    terminated = failed.status.container_statuses[0].state.terminated
    assert (terminated.exit_code, terminated.reason) == (78, "Error")
    assert terminated.message == "restoring\nrefused: config changed\n"


def test_follow_logs_streams_until_the_container_exits(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_pod(
        namespace, _pod("talker", ["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.2; done"])
    )
    eventually(
        lambda: _phase(core, namespace, "talker", "Running", "Succeeded"), what="talker started"
    )
    streamed = core.read_namespaced_pod_log("talker", namespace, follow=True)
    assert streamed.splitlines() == ["line1", "line2", "line3"]
    assert core.read_namespaced_pod_log("talker", namespace, tail_lines=1) == "line3\n"


def test_node_loss_freeze_then_restore(cluster: LocalCluster, client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_pod(namespace, _pod("frozen", ["sleep", "300"], grace=1))
    eventually(lambda: _ready(core, namespace, "frozen"), what="ready")
    pids = cluster.pod_pids(namespace, "frozen")
    cluster.lose_node("freeze")
    try:
        node = core.read_node("local")
        assert {c.type: c.status for c in node.status.conditions}["Ready"] == "Unknown"
        assert {t.key for t in node.spec.taints} == {"node.kubernetes.io/unreachable"}
        pod = core.read_namespaced_pod("frozen", namespace)
        assert {c.type: c.status for c in pod.status.conditions}["Ready"] == "False"
        assert pod.status.phase == "Running", "a lost node reports nothing: the last phase stays"
        # A wait: in namespace mode a process may still be in its launcher's mount calls,
        # where the stop signal lands once the call returns.
        eventually(lambda: all(_state(pid) == "T" for pid in pids), what="stopped")
        # Nobody acts on a deletion while the node is lost: the pod stays Terminating.
        core.create_namespaced_pod(namespace, _pod("unscheduled", ["sleep", "1"]))
        core.delete_namespaced_pod("frozen", namespace)
        assert core.read_namespaced_pod("frozen", namespace).metadata.deletion_timestamp is not None
        assert core.read_namespaced_pod("unscheduled", namespace).spec.node_name is None
    finally:
        cluster.restore_node()
    eventually(lambda: _gone(core, namespace, "frozen"), what="deletion carried out after restore")
    assert not [pid for pid in pids if _alive(pid)]
    assert eventually(
        lambda: _phase(core, namespace, "unscheduled", "Succeeded"), what="scheduled after restore"
    )


def test_a_pod_deleted_before_it_started_ends_failed_while_a_finalizer_holds_it(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    """As a kubelet >= 1.27 does: terminal before its deletion, not Pending forever."""
    core: Any = k8s.CoreV1Api(client)
    body = _pod("never-started", ["sleep", "300"], grace=1)
    body["metadata"]["finalizers"] = ["example.com/hold"]
    body["spec"]["nodeName"] = "local"
    cluster.lose_node("freeze")  # the kubelet sees the pod first when it is already deleted
    try:
        core.create_namespaced_pod(namespace, body)
        core.delete_namespaced_pod("never-started", namespace)
    finally:
        cluster.restore_node()
    try:
        failed = eventually(
            lambda: _phase(core, namespace, "never-started", "Failed"), what="Failed, not Pending"
        )
        conditions = {c.type: (c.status, c.reason) for c in failed.status.conditions}
        assert conditions["Ready"] == ("False", "PodCompleted")
        assert failed.metadata.deletion_timestamp is not None
        assert not failed.status.container_statuses  # nothing ever ran
    finally:
        core.patch_namespaced_pod("never-started", namespace, {"metadata": {"finalizers": None}})
    eventually(lambda: _gone(core, namespace, "never-started"), what="gone once released")


def test_node_loss_kill_reports_the_deaths_on_restore(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_pod(namespace, _pod("crashed", ["sleep", "300"]))
    eventually(lambda: _ready(core, namespace, "crashed"), what="ready")
    pids = cluster.pod_pids(namespace, "crashed")
    cluster.lose_node("kill")
    try:
        eventually(lambda: not [pid for pid in pids if _alive(pid)], what="processes killed")
        assert core.read_namespaced_pod("crashed", namespace).status.phase == "Running"
    finally:
        cluster.restore_node()
    failed = eventually(
        lambda: _phase(core, namespace, "crashed", "Failed"), what="failure reported"
    )
    assert failed.status.container_statuses[0].state.terminated.exit_code == 137
    assert os.path.isdir(cluster.directory / "pods" / namespace)


def test_two_nodes_replacements_schedule_away_from_a_lost_node(tmp_path: Path) -> None:
    from rolloutrun_localcluster.kubelet import free_pod_network
    from rolloutrun_localcluster.testing import api_client

    options: dict[str, Any] = {"nodes": 2, "restart_backoff": (0.2, 2.0)}
    with LocalCluster(tmp_path, pod_network=free_pod_network(), **options) as cluster:
        api = api_client(cluster)
        core: Any = k8s.CoreV1Api(api)
        pinned = _pod("pinned", ["sleep", "300"], grace=1, policy="Never")
        pinned["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "local"}
        core.create_namespaced_pod("default", pinned)
        eventually(lambda: _ready(core, "default", "pinned"), what="pinned ready")
        assert cluster.node_of("default", "pinned") == "local"
        pids = cluster.pod_pids("default", "pinned")
        cluster.lose_node("freeze", node="local")
        core.create_namespaced_pod("default", _pod("replacement", ["sleep", "300"], grace=1))
        eventually(lambda: _ready(core, "default", "replacement"), what="replacement ready")
        assert cluster.node_of("default", "replacement") == "local-2"
        waiting = _pod("waiting", ["true"])
        waiting["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "local"}
        core.create_namespaced_pod("default", waiting)

        def unschedulable() -> Any:
            conditions = core.read_namespaced_pod("waiting", "default").status.conditions or []
            return next(
                (c for c in conditions if c.type == "PodScheduled" and c.status == "False"), None
            )

        condition = eventually(unschedulable, what="unschedulable")
        assert condition.reason == "Unschedulable" and condition.message.startswith(
            "0/2 nodes are available"
        )
        # The operator gives up on the lost node's pod: a force deletion removes it at once.
        core.delete_namespaced_pod("pinned", "default", grace_period_seconds=0)
        assert _gone(core, "default", "pinned")
        assert all(_state(pid) == "T" for pid in pids), "a lost node's processes stay frozen"
        cluster.restore_node(node="local")
        eventually(
            lambda: not [pid for pid in pids if _alive(pid)], what="returning node kills them"
        )
        assert eventually(lambda: _phase(core, "default", "waiting", "Succeeded"), what="scheduled")
        assert cluster.node_of("default", "waiting") == "local"
        api.close()


SHOW_VOLUMES = """
import os, pathlib
root = pathlib.Path(os.environ.get("ROLLOUTRUN_LOCALCLUSTER_ROOT", "/"))  # loopback mode
print((root / "etc/run/run.yaml").read_text(), (root / "etc/meta/name").read_text(), os.getcwd())
"""


def test_volumes_are_files_under_the_pod_root_or_at_their_mount_paths(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "run"}, "data": {"run.yaml": "steps: 3"}}
    )
    pod = _pod(
        "vols",
        [PY, "-c", SHOW_VOLUMES],
        volumeMounts=[
            {"name": "config", "mountPath": "/etc/run"},
            {"name": "meta", "mountPath": "/etc/meta"},
        ],
        workingDir="/srv/app",
    )
    pod["spec"]["volumes"] = [
        {"name": "config", "configMap": {"name": "run"}},
        {
            "name": "meta",
            "downwardAPI": {
                "items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]
            },
        },
    ]
    core.create_namespaced_pod(namespace, pod)
    done = eventually(
        lambda: _phase(core, namespace, "vols", "Succeeded", "Failed"), what="vols done"
    )
    log = core.read_namespaced_pod_log("vols", namespace)
    assert done.status.phase == "Succeeded", log
    assert log.startswith("steps: 3 vols ")
    if cluster.isolation == LOOPBACK:
        assert log.split()[-1].endswith("/root/srv/app")
    else:  # made in the container's view only, not on the host
        assert log.split()[-1] == "/srv/app" and not os.path.exists("/srv/app")


RAY_TRAINER = """
import ray, time
ray.init(address="local", num_cpus=1, include_dashboard=False)
print("ray up", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_a_pods_ray_processes_die_with_it(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    """Ray's GCS, raylet and workers (some in their own process group) do not outlive the pod."""
    pytest.importorskip("ray")
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_pod(
        namespace, _pod("trainer", [PY, "-c", RAY_TRAINER], policy="Always", grace=2)
    )
    eventually(
        lambda: "ray up" in core.read_namespaced_pod_log("trainer", namespace), 180, what="ray up"
    )
    pids = cluster.pod_pids(namespace, "trainer")
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in pids if _alive(pid)}
    assert {"gcs_server", "raylet"} <= names, names
    core.delete_namespaced_pod("trainer", namespace)
    eventually(lambda: _gone(core, namespace, "trainer"), what="trainer gone")
    assert not [pid for pid in pids if _alive(pid)], "Ray processes outlived their pod"
