"""Image pulls and crash loops as a kubelet reports them: ``ErrImagePull`` then
``ImagePullBackOff`` (with the runtime's error), ``InvalidImageName``, ``ErrImageNeverPull``,
a pull that succeeds once the image exists; ``CrashLoopBackOff`` with the kubelet's
back-off (10 s doubling to 5 min, reset after 10 minutes) and ``restartCount``."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import watch as k8s_watch

from rolloutrun_localcluster import images, podspec
from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually


def test_references_normalize_as_a_runtime_resolves_them() -> None:
    assert images.normalize("busybox") == "docker.io/library/busybox:latest"
    assert images.normalize("team/gym:v2") == "docker.io/team/gym:v2"
    assert images.normalize("localhost:5000/gym") == "localhost:5000/gym:latest"
    assert images.normalize("ghcr.io/org/rolloutrun:0.1") == "ghcr.io/org/rolloutrun:0.1"
    assert images.normalize("Gym:v1") is None and images.normalize("a b") is None


def test_which_images_pull() -> None:
    registry = images.Images(["team/gym:v2"])
    assert registry.pull("busybox", "IfNotPresent") is None
    refused = registry.pull("docker.io/team/gym:v2", "Always")
    assert refused is not None and refused.reason == "ErrImagePull"
    assert refused.message == (
        'failed to pull and unpack image "docker.io/team/gym:v2": failed to resolve reference '
        '"docker.io/team/gym:v2": pull access denied, repository does not exist or may require '
        "authorization: server message: insufficient_scope: authorization failed"
    )
    nowhere = registry.pull("registry.invalid/gym:1", "IfNotPresent")
    assert nowhere is not None and nowhere.message.endswith(
        "dial tcp: lookup registry.invalid: no such host"
    )
    never = registry.pull("team/gym:v2", "Never")
    assert never == images.PullFailure(
        "ErrImageNeverPull",
        'Container image "team/gym:v2" is not present with pull policy of Never',
    )
    invalid = registry.pull("Gym:v1", "IfNotPresent")
    assert invalid is not None and (invalid.reason, invalid.retried) == ("InvalidImageName", False)
    registry.allow("team/gym:v2")
    assert registry.pull("team/gym:v2", "IfNotPresent") is None


def test_the_restart_back_off_doubles_to_its_cap_and_resets_after_twice_the_cap() -> None:
    record = podspec.ContainerRecord("main")
    base, cap = podspec.RESTART_BACKOFF
    delays = [podspec.restart_delay(record, float(t), base, cap) for t in range(7)]
    assert delays == [10, 20, 40, 80, 160, 300, 300]
    assert [podspec.go_duration(d) for d in delays[:6]] == [
        "10s", "20s", "40s", "1m20s", "2m40s", "5m0s",
    ]  # fmt: skip
    # within ten minutes of the last back-off it keeps growing; after, it starts again
    assert podspec.restart_delay(record, 6 + 600, base, cap) == 300
    assert podspec.restart_delay(record, 606 + 600.5, base, cap) == 10


def _pod(name: str, image: str, command: list[str], **spec: Any) -> dict[str, Any]:
    container = {"name": "main", "image": image, "command": command}
    return {
        "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 0, "containers": [container], **spec},
    }


def _waiting(core: Any, namespace: str, name: str, reason: str) -> Any:
    statuses = core.read_namespaced_pod(name, namespace).status.container_statuses or []
    waiting = statuses[0].state.waiting if statuses else None
    return waiting if waiting is not None and waiting.reason == reason else None


def _waiting_reasons_until(
    core: Any, namespace: str, name: str, since: str, last: str
) -> list[tuple[str, str]]:
    """The container's waiting reasons (and messages) in order, from a watch that starts at
    ``since``, until ``last`` is seen."""
    seen: list[tuple[str, str]] = []
    stream = k8s_watch.Watch()
    for event in stream.stream(
        core.list_namespaced_pod,
        namespace,
        field_selector=f"metadata.name={name}",
        resource_version=since,
        timeout_seconds=60,
    ):
        statuses = event["object"].status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        if waiting is None or waiting.reason in {None, "ContainerCreating"}:
            continue
        if not seen or seen[-1][0] != waiting.reason:
            seen.append((waiting.reason, waiting.message or ""))
        if waiting.reason == last:
            stream.stop()
            break
    return seen


def test_a_pull_fails_backs_off_and_succeeds_once_the_image_exists(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    image = f"example.com/{namespace}/gym:v1"
    cluster.images.refuse(image)
    sleep = ["sleep", "30"]
    since = core.list_namespaced_pod(namespace).metadata.resource_version
    core.create_namespaced_pod(namespace, _pod("refused", image, sleep))
    core.create_namespaced_pod(namespace, _pod("nowhere", "registry.invalid/gym:1", sleep))
    core.create_namespaced_pod(namespace, _pod("invalid", "Gym:v1", sleep))
    never = _pod("never", image, sleep)
    never["spec"]["containers"][0]["imagePullPolicy"] = "Never"
    core.create_namespaced_pod(namespace, never)
    # Every state the pod went through, from a watch (polling can miss the short ErrImagePull).
    seen = _waiting_reasons_until(core, namespace, "refused", since, "ImagePullBackOff")
    assert [reason for reason, _ in seen][:2] == ["ErrImagePull", "ImagePullBackOff"], seen
    assert "pull access denied" in seen[0][1]
    backing_off = eventually(
        lambda: _waiting(core, namespace, "refused", "ImagePullBackOff"), what="ImagePullBackOff"
    )
    assert backing_off.message.startswith(f'Back-off pulling image "{image}": ErrImagePull: ')
    pod = core.read_namespaced_pod("refused", namespace)
    assert pod.status.phase == "Pending" and pod.status.container_statuses[0].restart_count == 0
    eventually(lambda: _waiting(core, namespace, "nowhere", "ImagePullBackOff"), what="no host")
    eventually(lambda: _waiting(core, namespace, "invalid", "InvalidImageName"), what="invalid")
    # Before the image exists: a kubelet that first looks at "never" afterwards would run it.
    eventually(lambda: _waiting(core, namespace, "never", "ErrImageNeverPull"), what="never")
    cluster.images.allow(image)  # pushed: the next try (2 s back-off here) pulls and starts it
    eventually(
        lambda: core.read_namespaced_pod("refused", namespace).status.phase == "Running",
        timeout=60,
        what="the pod running once its image exists",
    )


@pytest.mark.parametrize("policy", ["Always", "OnFailure"])
def test_a_crashing_container_loops_with_the_kubelets_back_off(
    client: Any, namespace: str, policy: str
) -> None:
    """The cluster of these tests backs off from 0.2 s (``restart_backoff``; images 2 s)."""
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_pod(
        namespace, _pod("crasher", "busybox", ["sh", "-c", "exit 2"], restartPolicy=policy)
    )
    looping = eventually(
        lambda: _waiting(core, namespace, "crasher", "CrashLoopBackOff"), what="CrashLoopBackOff"
    )
    pod = core.read_namespaced_pod("crasher", namespace)
    uid = pod.metadata.uid
    assert looping.message.startswith("back-off ")
    assert looping.message.endswith(
        f" restarting failed container=main pod=crasher_{namespace}({uid})"
    )
    assert looping.message.split()[1] in {"200ms", "400ms", "800ms", "1.6s", "2s"}

    def restarted() -> Any:
        status = core.read_namespaced_pod("crasher", namespace).status.container_statuses[0]
        return status if status.restart_count >= 3 else None

    status = eventually(restarted, what="three restarts")
    assert status.last_state.terminated.exit_code == 2
    assert core.read_namespaced_pod("crasher", namespace).status.phase == "Running"


def test_unpullable_images_can_be_named_in_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv(images.ENV_UNPULLABLE, "team/gym:v2, ghcr.io/org/trainer:1")
    registry = images.Images.from_env(["busybox"])
    for image in ("team/gym:v2", "ghcr.io/org/trainer:1", "docker.io/library/busybox:latest"):
        assert registry.pull(image, "IfNotPresent") is not None, image
    assert registry.pull("team/gym:v3", "IfNotPresent") is None
