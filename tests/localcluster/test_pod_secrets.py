"""What the local cluster hands a pod stays that pod's: the token, the kubeconfig and Secret
volume files are owner-only (other users of a shared machine read none of them), a pod that
opts out of ``automountServiceAccountToken`` gets no token at all, and the API compares
bearer tokens in constant time."""

from __future__ import annotations

import hmac
import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually

PY = sys.executable

#: Prints what the pod can see of its credentials, then stays up (its directory is kept).
SHOW_CREDENTIALS = """
import json, os, pathlib, time, yaml
pod = pathlib.Path(os.environ["ROLLOUTRUN_LOCALCLUSTER_POD_DIR"])
config = yaml.safe_load(pathlib.Path(os.environ["KUBECONFIG"]).read_text())
print("CREDS " + json.dumps({
    "token_file": (pod / "serviceaccount" / "token").exists(),
    "user": config["users"][0]["user"],
    "env": sorted(os.environ.values()),
}), flush=True)
time.sleep(300)
"""


@pytest.fixture
def default_umask() -> Iterator[None]:
    """The usual umask (group and others may read new files): the cluster must not rely on
    a stricter one."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _pod(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "main", "image": "ignored", "command": [PY, "-c", SHOW_CREDENTIALS]}
            ],
            **spec,
        },
    }


def _credentials(core: Any, namespace: str, name: str) -> dict[str, Any]:
    def seen() -> str | None:
        log = core.read_namespaced_pod_log(name, namespace)
        return log if "CREDS " in log else None

    log = eventually(seen, what=f"{name} printed its credentials")
    return dict(json.loads(log.split("CREDS ", 1)[1].splitlines()[0]))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_tokens_kubeconfigs_and_secret_volumes_are_owner_only(
    cluster: LocalCluster, client: Any, namespace: str, default_umask: None
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_secret(
        namespace, {"metadata": {"name": "creds"}, "stringData": {"key.json": "{}"}}
    )
    pod = _pod("private", volumes=[{"name": "creds", "secret": {"secretName": "creds"}}])
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "creds", "mountPath": "/var/creds"}]
    core.create_namespaced_pod(namespace, pod)
    assert _credentials(core, namespace, "private")["token_file"] is True
    directory = cluster.pod_dir(namespace, "private")
    assert directory is not None
    for private_dir in (
        directory.parent,
        directory,
        directory / "serviceaccount",
        directory / "volumes",
        directory / "volumes" / "creds",
    ):
        assert _mode(private_dir) == 0o700, private_dir
    for private_file in (
        directory / "serviceaccount" / "token",
        directory / "kubeconfig",
        directory / "volumes" / "creds" / "key.json",
    ):
        assert _mode(private_file) == 0o600, private_file


def test_a_pod_that_opts_out_gets_no_token(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_service_account(
        namespace, {"metadata": {"name": "quiet"}, "automountServiceAccountToken": False}
    )
    core.create_namespaced_pod(namespace, _pod("own", automountServiceAccountToken=False))
    core.create_namespaced_pod(namespace, _pod("inherited", serviceAccountName="quiet"))
    core.create_namespaced_pod(
        namespace,
        _pod("overridden", serviceAccountName="quiet", automountServiceAccountToken=True),
    )
    core.create_namespaced_pod(namespace, _pod("default"))
    for name in ("own", "inherited"):
        seen = _credentials(core, namespace, name)
        assert seen["token_file"] is False, name
        assert seen["user"] == {}, name
        assert not [value for value in seen["env"] if cluster.token in value], name
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    for name, account in (("overridden", "quiet"), ("default", "default")):
        seen = _credentials(core, namespace, name)
        assert seen["token_file"] is True and set(seen["user"]) == {"token"}, name
        assert seen["user"]["token"] != cluster.token, name  # its account's, never the admin's
        whoami = http.request(
            "POST",
            f"{cluster.api_url}/apis/authentication.k8s.io/v1/selfsubjectreviews",
            body=b"{}",
            headers={"Authorization": f"Bearer {seen['user']['token']}"},
        )
        user = json.loads(whoami.data)["status"]["userInfo"]["username"]
        assert user == f"system:serviceaccount:{namespace}:{account}", name


def test_wrong_tokens_are_401_and_compared_in_constant_time(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def recording(a: Any, b: Any) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    url = f"{cluster.api_url}/api/v1/namespaces"
    wrong = (
        f"Bearer {cluster.token[:-1]}",  # all but the last character right
        f"Bearer {cluster.token}x",
        "Bearer",
        f"bearer {cluster.token}",
        "Bearer \u00e9t\u00e9",  # not ASCII: still a 401, not a 500
    )
    for header in wrong:
        answer = http.request("GET", url, headers={"Authorization": header})
        assert answer.status == 401, (header, answer.data)
        assert json.loads(answer.data)["reason"] == "Unauthorized"
    right = http.request("GET", url, headers={"Authorization": f"Bearer {cluster.token}"})
    assert right.status == 200
    assert len(compared) >= len(wrong) + 1
