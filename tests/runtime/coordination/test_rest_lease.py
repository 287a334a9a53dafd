"""RestLease: the run's Lease over plain HTTPS, against the local cluster's real API server
(TLS, tokens, RBAC): the semantics of KubernetesLease (resourceVersion conflicts, take-over
by a newer incarnation, fencing, progress annotations), without the kubernetes client; and
which credentials it takes (in-cluster first, then one kubeconfig; anything it does not
understand: None, the keeper then uses the client)."""

from __future__ import annotations

import base64
import ssl
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_runtime.contract.pod import (
    ENV_INCARNATION,
    ENV_LEASE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
)
from rolloutrun_runtime.coordination import FencedError, LeaseError, LeaseHolder, holder_identity
from rolloutrun_runtime.lease_rest import (
    ApiAccess,
    RestLease,
    access_from_environment,
    in_cluster_access,
    kubeconfig_access,
    rest_lease_from_environment,
)
from tests.support.races import at_once


@pytest.fixture(scope="module")
def access(cluster: LocalCluster) -> ApiAccess:
    found = access_from_environment({"KUBECONFIG": str(cluster.kubeconfig_path)})
    assert found is not None
    return found


def trainer(access: ApiAccess, name: str, incarnation: int, pod: str | None = None) -> RestLease:
    identity = holder_identity(pod or f"run-i{incarnation}-trainer", incarnation)
    return RestLease(name, "default", identity, incarnation, access)


def read(api: Any, name: str) -> Any:
    from kubernetes import client as k8s

    leases: Any = k8s.CoordinationV1Api(api)
    return leases.read_namespaced_lease(name, "default")


def test_acquire_renew_progress_and_release_on_a_real_lease(api, access, lease_name):
    lease = trainer(access, lease_name, 1)
    assert isinstance(lease, LeaseHolder)
    lease.acquire(timeout=10)
    lease.renew()
    lease.ensure_held()
    lease.record_progress(train_step=3, anchor_step=0, latest_manifest="gs://b/run/m3.json")
    stored = read(api, lease_name)  # read back with the kubernetes client: a valid Lease
    assert stored.spec.holder_identity == "run-i1-trainer/1"
    assert stored.spec.renew_time is not None and stored.spec.lease_duration_seconds == 15
    assert stored.spec.acquire_time is not None
    assert stored.metadata.annotations["rolloutrun.dev/train-step"] == "3"
    assert lease.annotations(fresh=True)["rolloutrun.dev/latest-manifest"] == "gs://b/run/m3.json"
    lease.stop(release=True)
    assert read(api, lease_name).spec.holder_identity is None
    assert read(api, lease_name).metadata.annotations["rolloutrun.dev/train-step"] == "3"


def test_a_newer_incarnation_takes_over_and_fences_the_old_one(api, access, lease_name):
    old, new = trainer(access, lease_name, 1), trainer(access, lease_name, 2)
    old.acquire(timeout=10)
    new.acquire(timeout=10)
    with pytest.raises(FencedError):
        old.ensure_held()
    with pytest.raises(FencedError):
        old.record_progress(latest_manifest="gs://b/run/stale.json")
    assert read(api, lease_name).spec.holder_identity == "run-i2-trainer/2"
    assert "rolloutrun.dev/latest-manifest" not in (
        read(api, lease_name).metadata.annotations or {}
    )


def test_a_stale_resource_version_is_a_conflict_not_an_overwrite(api, access, lease_name):
    first, second = trainer(access, lease_name, 1, "a"), trainer(access, lease_name, 1, "b")
    record, version = first._read()
    second.acquire(timeout=10)
    assert first._write(record, version) is False
    assert read(api, lease_name).spec.holder_identity == "b/1"


def test_racing_trainers_elect_exactly_one_holder(access, lease_name):
    leases = [trainer(access, lease_name, 1, f"p{i}") for i in range(6)]
    wins = at_once([lease.try_acquire for lease in leases])
    assert sorted(wins) == [False] * 5 + [True]


def test_a_missing_lease_and_an_unreachable_server_are_clear_errors(access, lease_name):
    with pytest.raises(LeaseError, match="operator creates it"):
        trainer(access, "no-such-lease", 1).acquire(timeout=1)
    nowhere = ApiAccess("http://127.0.0.1:1", None, lambda: None)
    with pytest.raises(LeaseError, match="unreachable"):
        trainer(nowhere, lease_name, 1).try_acquire()


def test_a_kept_alive_connection_that_broke_is_dialled_again_once(access, lease_name):
    import socket

    lease = trainer(access, lease_name, 1)
    lease.acquire(timeout=10)
    assert len(lease._idle) == 1 and lease._idle[0].sock is not None  # one at a time: one
    lease._idle[0].sock.shutdown(socket.SHUT_RDWR)  # as a server closing it would
    lease.ensure_held()  # answered on a fresh connection
    lease.renew()
    lease.stop(release=True)


def test_without_a_token_the_api_refuses_and_the_lease_says_so(access, lease_name):
    anonymous = ApiAccess(access.server, access.context, lambda: None)
    with pytest.raises(LeaseError, match=r"401|403"):
        trainer(anonymous, lease_name, 1).try_acquire()


def _kubeconfig(cluster: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    return {
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }


def test_credentials_it_does_not_understand_are_left_to_the_client(tmp_path: Path):
    server = {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}
    assert kubeconfig_access(_kubeconfig(server, {"token": "t"}), tmp_path) is not None
    for user in (
        {"exec": {"command": "aws"}},
        {"auth-provider": {"name": "gcp"}},
        {"username": "u", "password": "p"},
    ):
        assert kubeconfig_access(_kubeconfig(server, user), tmp_path) is None
    proxied = {**server, "proxy-url": "http://proxy:3128"}
    assert kubeconfig_access(_kubeconfig(proxied, {"token": "t"}), tmp_path) is None
    config = _kubeconfig(server, {"token": "t"})
    assert kubeconfig_access({**config, "current-context": "other"}, tmp_path) is None
    assert access_from_environment({"KUBECONFIG": f"{tmp_path}/a:{tmp_path}/b"}) is None


def test_a_cluster_ca_is_the_only_one_trusted(access: ApiAccess):
    """As the client trusts it (and the system's ~150 CAs cost ~40 ms of CPU to load)."""
    assert access.context is not None
    assert access.context.cert_store_stats()["x509_ca"] == 1
    assert access.context.verify_mode == ssl.CERT_REQUIRED and access.context.check_hostname


def test_a_kubeconfig_token_file_is_read_at_each_request(tmp_path: Path):
    (tmp_path / "token").write_text("first\n")
    server = {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True}
    found = kubeconfig_access(_kubeconfig(server, {"tokenFile": "token"}), tmp_path)
    assert found is not None and found.token() == "first"
    (tmp_path / "token").write_text("rotated")
    assert found.token() == "rotated"


def test_in_cluster_credentials_come_first(cluster: LocalCluster, tmp_path: Path):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    ca = yaml.safe_load(cluster.kubeconfig_path.read_text())["clusters"][0]["cluster"]
    (account / "ca.crt").write_bytes(base64.b64decode(ca["certificate-authority-data"]))
    environ = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_access(environ, account) is None  # no token mounted
    (account / "token").write_text("pod-token")
    found = in_cluster_access(environ, account)
    assert found is not None and found.server == "https://10.0.0.1:443"
    assert found.token() == "pod-token"
    ipv6 = in_cluster_access({**environ, "KUBERNETES_SERVICE_HOST": "fd00::1"}, account)
    assert ipv6 is not None and ipv6.server == "https://[fd00::1]:443"


def test_the_pod_environment_names_the_lease_and_identity(cluster: LocalCluster):
    pod = {
        "KUBECONFIG": str(cluster.kubeconfig_path),
        ENV_LEASE_NAME: "run-trainer",
        ENV_POD_NAMESPACE: "default",
        ENV_POD_NAME: "run-i3-trainer",
        ENV_INCARNATION: "3",
    }
    lease = rest_lease_from_environment(pod)
    assert lease is not None
    assert (lease.name, lease.namespace) == ("run-trainer", "default")
    assert lease.identity == "run-i3-trainer/3"
    outside = {k: v for k, v in pod.items() if k != ENV_LEASE_NAME}
    assert rest_lease_from_environment(outside) is None
