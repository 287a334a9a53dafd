"""Each pod its own filesystem view (namespace mode) and claims that outlive pods.

A file a pod writes to ``/tmp`` dies with it; one on a PersistentVolumeClaim is seen by
the pod's replacement; ConfigMap and Secret volumes are files at their mount paths for
any program (``cat``); a read-only root refuses writes; nothing is created on the host.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from rolloutrun_localcluster import mountns
from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import api_client, eventually, local_cluster
from tests.support.kube_objects import pod_gone as _gone

pytestmark = pytest.mark.skipif(
    not mountns.namespaces_permitted(), reason="mount namespaces are not permitted here"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    directory = tmp_path_factory.mktemp("mountns")
    yield from local_cluster(directory, restart_backoff=(0.2, 2.0), isolation="namespaces")


@pytest.fixture(scope="module")
def client(cluster: LocalCluster) -> Iterator[Any]:
    api = api_client(cluster)
    yield api
    api.close()


def _pod(name: str, script: str, mounts: list[Any], volumes: list[Any], **extra: Any) -> Any:
    container = {"name": "main", "image": "busybox", "command": ["sh", "-c", script]}
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [{**container, "volumeMounts": mounts, **extra}],
            "volumes": volumes,
        },
    }


def _finish(core: Any, namespace: str, name: str) -> tuple[str, str]:
    def done() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase in ("Succeeded", "Failed") else None

    phase = eventually(done, what=f"{name} to finish").status.phase
    return phase, core.read_namespaced_pod_log(name, namespace)


def _claim(name: str, **spec: Any) -> Any:
    body = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    return {"metadata": {"name": name}, "spec": {**body, **spec}}


def _bound(core: Any, namespace: str, name: str) -> Any:
    claim = core.read_namespaced_persistent_volume_claim(name, namespace)
    return claim if claim.status.phase == "Bound" else None


CLAIM = [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]
TMP_AND_CLAIM = [{"name": "data", "mountPath": "/data/run"}]


def test_tmp_dies_with_the_pod_and_the_claim_outlives_it(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_persistent_volume_claim(namespace, _claim("data"))
    claim = eventually(lambda: _bound(core, namespace, "data"), what="claim bound")
    volume = core.read_persistent_volume(claim.spec.volume_name)
    assert volume.status.phase == "Bound" and volume.spec.claim_ref.name == "data"
    assert claim.spec.storage_class_name == "standard"
    write = "echo gone > /tmp/marker && echo kept > /data/run/checkpoint"
    core.create_namespaced_pod(namespace, _pod("worker", write, TMP_AND_CLAIM, CLAIM))
    assert _finish(core, namespace, "worker")[0] == "Succeeded"
    core.delete_namespaced_pod("worker", namespace)
    eventually(lambda: _gone(core, namespace, "worker"), what="worker gone")
    read = "test ! -e /tmp/marker && echo no-tmp-marker; cat /data/run/checkpoint"
    core.create_namespaced_pod(namespace, _pod("worker", read, TMP_AND_CLAIM, CLAIM))
    phase, log = _finish(core, namespace, "worker")
    assert (phase, log.split()) == ("Succeeded", ["no-tmp-marker", "kept"])
    assert (Path(volume.spec.host_path.path) / "checkpoint").read_text() == "kept\n"
    assert not os.path.exists("/data")  # the mount point was made in the pod's view only


def test_config_map_and_secret_volumes_are_files_at_their_mount_paths(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "app"}, "data": {"app.yaml": "steps: 3\n"}}
    )
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"password": "hunter2"}}
    )
    mounts = [
        {"name": "app", "mountPath": "/etc/app", "readOnly": True},
        {"name": "app", "mountPath": "/opt/single.yaml", "subPath": "app.yaml"},
        {"name": "creds", "mountPath": "/var/run/creds", "readOnly": True},
    ]
    volumes = [
        {"name": "app", "configMap": {"name": "app"}},
        {"name": "creds", "secret": {"secretName": "creds"}},
    ]
    script = (
        "cat /etc/app/app.yaml /opt/single.yaml /var/run/creds/password; echo; "
        "echo x > /etc/app/new || echo refused"
    )
    core.create_namespaced_pod(namespace, _pod("reader", script, mounts, volumes))
    phase, log = _finish(core, namespace, "reader")
    assert phase == "Succeeded", log
    assert log.splitlines()[:3] == ["steps: 3", "steps: 3", "hunter2"]
    assert "Read-only file system" in log and log.rstrip().endswith("refused")
    assert not os.path.exists("/etc/app") and not os.path.exists("/opt/single.yaml")


def test_a_read_only_root_refuses_writes_but_volumes_and_tmp_take_them(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    script = (
        "echo a > /tmp/a && echo b > /work/b && echo wrote-volumes; echo c > /var/c || echo refused"
    )
    pod = _pod(
        "readonly",
        script,
        [{"name": "work", "mountPath": "/work"}],
        [{"name": "work", "emptyDir": {}}],
        securityContext={"readOnlyRootFilesystem": True},
    )
    core.create_namespaced_pod(namespace, pod)
    phase, log = _finish(core, namespace, "readonly")
    assert phase == "Succeeded", log
    assert "wrote-volumes" in log and "Read-only file system" in log and "refused" in log
    assert not os.path.exists("/var/c")


def test_pods_in_namespace_mode_get_no_loopback_root(cluster: LocalCluster, client: Any) -> None:
    core: Any = k8s.CoreV1Api(client)
    node = core.read_node("local")
    assert node.metadata.annotations[mountns.ISOLATION_ANNOTATION] == "namespaces"
    assert cluster.isolation == "namespaces"


def test_a_pod_waits_for_a_missing_or_unbound_claim_with_the_schedulers_message(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    pod = _pod("waiting", "cat /data/run/x", TMP_AND_CLAIM, CLAIM)
    core.create_namespaced_pod(namespace, pod)

    def scheduled_message() -> str | None:
        status = core.read_namespaced_pod("waiting", namespace).status
        for condition in status.conditions or []:
            if condition.type == "PodScheduled" and condition.status == "False":
                return str(condition.message)
        return None

    message = eventually(scheduled_message, what="unschedulable")
    assert message.startswith('0/1 nodes are available: persistentvolumeclaim "data" not found.')
    core.create_namespaced_persistent_volume_claim(namespace, _claim("data", storageClassName=""))
    eventually(
        lambda: "unbound immediate PersistentVolumeClaims" in (scheduled_message() or ""),
        what="unbound claim message",
    )
    assert core.read_namespaced_persistent_volume_claim("data", namespace).status.phase == "Pending"
    assert core.read_namespaced_pod("waiting", namespace).spec.node_name is None


def test_a_claim_deleted_while_in_use_waits_then_takes_its_volume_and_directory(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    storage: Any = k8s.StorageV1Api(client)
    default = storage.read_storage_class("standard")
    annotations = default.metadata.annotations
    assert annotations["storageclass.kubernetes.io/is-default-class"] == "true"
    core.create_namespaced_persistent_volume_claim(namespace, _claim("scratch"))
    claim = eventually(lambda: _bound(core, namespace, "scratch"), what="claim bound")
    directory = Path(core.read_persistent_volume(claim.spec.volume_name).spec.host_path.path)
    assert directory.is_dir()
    mounts = [{"name": "scratch", "mountPath": "/scratch"}]
    volumes = [{"name": "scratch", "persistentVolumeClaim": {"claimName": "scratch"}}]
    core.create_namespaced_pod(namespace, _pod("user", "sleep 600", mounts, volumes))
    eventually(
        lambda: core.read_namespaced_pod("user", namespace).status.phase == "Running",
        what="user running",
    )
    core.delete_namespaced_persistent_volume_claim("scratch", namespace)
    held = core.read_namespaced_persistent_volume_claim("scratch", namespace)
    assert held.metadata.deletion_timestamp and held.metadata.finalizers == [
        "kubernetes.io/pvc-protection"
    ]
    core.delete_namespaced_pod("user", namespace, grace_period_seconds=0)

    def volume_gone() -> bool:
        try:
            core.read_persistent_volume(claim.spec.volume_name)
        except k8s.ApiException as error:
            return error.status == 404
        return False

    eventually(volume_gone, what="volume deleted")
    assert not directory.exists()


def test_the_mode_is_chosen_by_argument_then_environment() -> None:
    assert mountns.choose_mode("loopback") == "loopback"
    assert mountns.choose_mode(None, {mountns.ENV_ISOLATION: "loopback"}) == "loopback"
    assert mountns.choose_mode(None, {}) == "namespaces"
    with pytest.raises(ValueError, match="isolation must be one of namespaces, loopback"):
        mountns.choose_mode("chroot")


def test_rolloutrun_run_keeps_the_runs_storage_and_logs_on_a_claim(tmp_path: Path) -> None:
    from rolloutrun_localcluster.embedded import localize

    document = {"kind": "RolloutRun", "metadata": {"name": "tiny"}, "spec": {}}
    run = localize(document, tmp_path, "default")
    assert run["spec"]["storage"] == {
        "uri": f"file://{tmp_path.resolve()}/storage",
        "volumeClaimName": "tiny-storage",
    }
    assert run["spec"]["run"]["logDir"] == f"{tmp_path.resolve()}/storage/logs"


def test_a_claim_naming_its_volume_binds_to_it_and_pods_see_its_directory(
    cluster: LocalCluster, client: Any, namespace: str, tmp_path: Path
) -> None:
    from rolloutrun_localcluster.storage_provisioner import static_claim

    core: Any = k8s.CoreV1Api(client)
    directory = tmp_path / "storage"
    directory.mkdir()
    (directory / "seed").write_text("from the host\n")
    pv, claim = static_claim("static", namespace, directory)
    core.create_persistent_volume(pv)
    core.create_namespaced_persistent_volume_claim(namespace, claim)
    eventually(lambda: _bound(core, namespace, "static-storage"), what="static claim bound")
    assert core.read_persistent_volume(pv["metadata"]["name"]).spec.claim_ref.name == (
        "static-storage"
    )
    mounts = [{"name": "s", "mountPath": str(directory)}]
    volumes = [{"name": "s", "persistentVolumeClaim": {"claimName": "static-storage"}}]
    script = f"cat {directory}/seed && echo from-the-pod > {directory}/written"
    core.create_namespaced_pod(namespace, _pod("static", script, mounts, volumes))
    phase, log = _finish(core, namespace, "static")
    assert (phase, log) == ("Succeeded", "from the host\n")
    assert (directory / "written").read_text() == "from-the-pod\n"


@pytest.fixture(params=["under-tmp", "outside-tmp"])
def checkout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A project checkout: under /tmp (behind the pod's private /tmp, as CI's and a user's
    clone under /tmp), or where the pod's /tmp does not reach (/var/tmp)."""
    if request.param == "under-tmp":
        yield tmp_path / "checkout"
        return
    if not os.path.isdir("/var/tmp"):
        pytest.skip("no /var/tmp here")
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="mountns-") as directory:
        yield Path(directory) / "checkout"


def test_a_claim_below_a_kept_checkout_is_the_pods_volume_with_a_read_only_root(
    client: Any, namespace: str, checkout: Path
) -> None:
    """``rolloutrun run`` from a clone under /tmp: the run's claim lies in the checkout
    (``.rolloutrun/<run>/storage``), which pods keep seeing (their programs); the kept
    checkout was bound over the claim's mount, and every Gym pod (read-only root) exited
    with ``mountns: mount_setattr <run>/storage/gym-audit: Invalid argument``."""
    from rolloutrun_localcluster.storage_provisioner import static_claim

    core: Any = k8s.CoreV1Api(client)
    directory = checkout / ".rolloutrun" / "run" / "storage"
    directory.mkdir(parents=True)
    (checkout / "program").write_text("kept\n")
    pv, claim = static_claim("kept", namespace, directory)
    core.create_persistent_volume(pv)
    core.create_namespaced_persistent_volume_claim(namespace, claim)
    eventually(lambda: _bound(core, namespace, "kept-storage"), what="static claim bound")
    mounts = [{"name": "s", "mountPath": str(directory)}]
    volumes = [{"name": "s", "persistentVolumeClaim": {"claimName": "kept-storage"}}]
    script = (
        f"cat {checkout}/program && echo from-the-pod > {directory}/written && "
        f"grep -q ' {directory} ' /proc/self/mountinfo && echo a-mount; "
        f"echo x > {checkout}/other || echo refused"
    )
    env = [{"name": "PYTHONPATH", "value": str(checkout)}]  # kept: the pod's programs
    pod = _pod(
        "kept", script, mounts, volumes, env=env, securityContext={"readOnlyRootFilesystem": True}
    )
    core.create_namespaced_pod(namespace, pod)
    phase, log = _finish(core, namespace, "kept")
    assert phase == "Succeeded", log
    assert log.splitlines()[:2] == ["kept", "a-mount"] and log.rstrip().endswith("refused")
    assert (directory / "written").read_text() == "from-the-pod\n"
    assert not (checkout / "other").exists()


def test_a_pod_sees_its_own_directory_but_not_other_pods_or_claims(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_persistent_volume_claim(namespace, _claim("private"))
    eventually(lambda: _bound(core, namespace, "private"), what="claim bound")
    pods = cluster.directory / "pods" / namespace
    script = f"ls {pods}; ls {cluster.directory / 'volumes'} || echo no-volumes"
    core.create_namespaced_pod(namespace, _pod("other", "sleep 600", [], []))
    eventually(lambda: cluster.pod_dir(namespace, "other"), what="other started")
    core.create_namespaced_pod(namespace, _pod("looker", script, [], []))
    phase, log = _finish(core, namespace, "looker")
    assert phase == "Succeeded", log
    (own,) = [line for line in log.splitlines() if line.startswith("looker-")]
    assert not [line for line in log.splitlines() if line.startswith("other-")]
    assert "no-volumes" in log and (pods / own).is_dir()


def test_the_plan_binds_each_mount_adds_a_private_tmp_and_keeps_hidden_programs() -> None:
    container = {
        "name": "main",
        "workingDir": "/work",
        "securityContext": {"readOnlyRootFilesystem": True},
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/app/", "readOnly": True},
            {"name": "cfg", "mountPath": "/opt/one.yaml", "subPath": "one.yaml"},
        ],
    }
    spec = mountns.plan(
        {},
        container,
        {"cfg": "/c/pods/p/volumes/cfg"},
        "/c/pods/p",
        "/c/pods/p/tmp",
        ["/usr/bin", "/tmp/shims/bin"],
        "/c",
    )
    assert [(m["target"], m["source"], m["readOnly"]) for m in spec["mounts"]] == [
        ("/tmp", "/c/pods/p/tmp", False),
        ("/etc/app", "/c/pods/p/volumes/cfg", True),
        ("/opt/one.yaml", "/c/pods/p/volumes/cfg/one.yaml", False),
    ]
    assert spec["keep"] == ["/c/pods/p", "/tmp/shims/bin"]  # /usr/bin is not hidden
    assert (spec["readOnlyRoot"], spec["workingDir"], spec["hide"]) == (True, "/work", ["/c"])
    with_tmp = {**container, "volumeMounts": [{"name": "cfg", "mountPath": "/tmp"}]}
    targets = [
        m["target"] for m in mountns.plan({}, with_tmp, {"cfg": "/v"}, "/p", "/t", [])["mounts"]
    ]
    assert targets == ["/tmp"]  # the volume, not the pod's private directory
    with pytest.raises(ValueError, match='volume "gone" not found'):
        mountns.plan(
            {}, {"volumeMounts": [{"name": "gone", "mountPath": "/x"}]}, {}, "/p", "/t", []
        )


def test_a_checkout_under_tmp_stays_visible_and_tmp_itself_is_never_kept() -> None:
    """CI clones the project under /tmp: the editable install maps the packages to that
    source tree, on no PATH or PYTHONPATH entry; pods must go on seeing it behind their
    private /tmp (they failed with ``No module named 'rolloutrun_runtime'``)."""
    import rolloutrun_runtime

    root = os.path.dirname(os.path.dirname(rolloutrun_runtime.__file__))
    assert root in mountns.keep_paths({})
    keep = ["/tmp", "/tmp/ci.x/main/runtime"]
    spec = mountns.plan({}, {"name": "main"}, {}, "/c/pods/p", "/c/pods/p/tmp", keep, "/c")
    assert spec["keep"] == ["/c/pods/p", "/tmp/ci.x/main/runtime"]  # not /tmp: the mount stays
    mounted = {"name": "main", "volumeMounts": [{"name": "v", "mountPath": "/tmp/ci.x/main"}]}
    keep = ["/tmp/ci.x/main", "/tmp/ci.x/main/runtime"]
    spec = mountns.plan({}, mounted, {"v": "/v"}, "/c/pods/p", "/c/pods/p/tmp", keep, "/c")
    assert spec["keep"] == ["/c/pods/p", "/tmp/ci.x/main/runtime"]  # the volume, not the host's


def test_where_mount_namespaces_are_not_permitted_loopback_is_chosen_and_namespaces_refused() -> (
    None
):
    import subprocess
    import sys

    script = (
        "from rolloutrun_localcluster import mountns\n"
        "print(mountns.choose_mode(None))\n"
        "try:\n    mountns.choose_mode('namespaces')\n"
        "except RuntimeError as error:\n    print(error)\n"
    )
    # no `unshare` on the PATH: the detection's probe cannot run, as on a machine without it
    package_root = str(Path(mountns.__file__).resolve().parents[1])  # this tree's package
    env = {**os.environ, "PATH": "/nonexistent", "PYTHONPATH": package_root}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    lines = done.stdout.splitlines()
    assert lines[0] == "loopback"
    assert lines[1].startswith("isolation=namespaces: this process may not create mount")


def test_an_exec_probe_runs_in_the_containers_own_view(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "flag"}, "data": {"ready": "yes"}}
    )
    probe = {"exec": {"command": ["cat", "/etc/flag/ready", "here"]}, "periodSeconds": 1}
    pod = _pod(
        "probed",
        "touch here && sleep 600",
        [{"name": "flag", "mountPath": "/etc/flag"}, {"name": "work", "mountPath": "/work"}],
        [{"name": "flag", "configMap": {"name": "flag"}}, {"name": "work", "emptyDir": {}}],
        workingDir="/work",
        readinessProbe=probe,
    )
    core.create_namespaced_pod(namespace, pod)

    def ready() -> bool:
        statuses = core.read_namespaced_pod("probed", namespace).status.container_statuses
        return bool(statuses and statuses[0].ready)

    eventually(ready, what="ready by a probe reading the pod's own mount and working dir")
