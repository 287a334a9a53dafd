"""Watches (replay from a resourceVersion, selector transitions, bookmarks, 410 Gone,
timeoutSeconds, initial events) and garbage collection (background, foreground, orphan,
namespace deletion) over HTTP."""

from __future__ import annotations

import json
from typing import Any

import pytest
import urllib3
from kubernetes import client as k8s
from kubernetes import watch

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually


def _watch(cluster: LocalCluster, path: str, **params: str) -> list[dict[str, Any]]:
    """Every event of one watch request, read until the server ends it (timeoutSeconds)."""
    http = urllib3.PoolManager(ca_certs=str(cluster.ca_path))
    response = http.request(
        "GET",
        f"{cluster.api_url}{path}",
        fields={"watch": "true", **params},
        headers={"Authorization": f"Bearer {cluster.token}"},
        preload_content=False,
    )
    assert response.status == 200
    lines = b"".join(response.stream(1024)).splitlines()
    response.release_conn()
    return [json.loads(line) for line in lines if line.strip()]


def test_watch_replays_from_a_resource_version(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    listed = core.list_namespaced_config_map(namespace)
    since = listed.metadata.resource_version
    core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "w", "labels": {"pick": "yes"}}}
    )
    core.patch_namespaced_config_map("w", namespace, {"data": {"a": "1"}})
    core.patch_namespaced_config_map("w", namespace, {"metadata": {"labels": {"pick": "no"}}})
    core.delete_namespaced_config_map("w", namespace)
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    events = _watch(cluster, path, resourceVersion=since, timeoutSeconds="1")
    assert [e["type"] for e in events if e["type"] != "BOOKMARK"] == [
        "ADDED",
        "MODIFIED",
        "MODIFIED",
        "DELETED",
    ]
    versions = [
        int(e["object"]["metadata"]["resourceVersion"]) for e in events if e["type"] != "BOOKMARK"
    ]
    assert versions == sorted(versions) and versions[0] > int(since)
    # A selector-filtered watch sees the object leave the selection as DELETED.
    picked = _watch(
        cluster, path, resourceVersion=since, timeoutSeconds="1", labelSelector="pick=yes"
    )
    assert [e["type"] for e in picked] == ["ADDED", "MODIFIED", "DELETED"]
    assert picked[-1]["object"]["metadata"]["labels"] == {"pick": "no"}


def test_watch_bookmarks_initial_events_and_gone(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "b"}})
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    # No resourceVersion: the current state as ADDED events, then the end-of-initial bookmark.
    initial = _watch(
        cluster,
        path,
        timeoutSeconds="1",
        allowWatchBookmarks="true",
        sendInitialEvents="true",
        resourceVersionMatch="NotOlderThan",
    )
    names = [e["object"]["metadata"]["name"] for e in initial if e["type"] == "ADDED"]
    assert "b" in names
    bookmarks = [e for e in initial if e["type"] == "BOOKMARK"]
    assert bookmarks[0]["object"]["metadata"]["annotations"] == {
        "k8s.io/initial-events-end": "true"
    }
    assert any(int(b["object"]["metadata"]["resourceVersion"]) > 0 for b in bookmarks[1:]), (
        "idle bookmarks"
    )
    # After compaction, a watch from an old version is told 410 Gone inside the stream.
    old = core.list_namespaced_config_map(namespace).metadata.resource_version
    core.patch_namespaced_config_map("b", namespace, {"data": {"x": "y"}})
    cluster.compact()
    gone = _watch(cluster, path, resourceVersion=old, timeoutSeconds="1")
    assert gone[0]["type"] == "ERROR"
    assert gone[0]["object"]["code"] == 410 and gone[0]["object"]["reason"] == "Expired"
    # The kubernetes client's Watch sees the same stream.
    stream = watch.Watch().stream(core.list_namespaced_config_map, namespace, timeout_seconds=1)
    assert "b" in [event["object"].metadata.name for event in stream]


def _cm(
    namespace: str, name: str, owner: Any = None, finalizers: list[str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": owner.metadata.name,
                "uid": owner.metadata.uid,
                "blockOwnerDeletion": True,
            }
        ]
    if finalizers:
        meta["finalizers"] = finalizers
    return {"metadata": meta}


def _absent(core: Any, namespace: str, name: str) -> Any:
    return lambda: _exists(core, namespace, name) is None


def _exists(core: Any, namespace: str, name: str) -> Any:
    try:
        return core.read_namespaced_config_map(name, namespace)
    except k8s.ApiException as error:
        if error.status == 404:
            return None
        raise


@pytest.mark.parametrize("policy", ["Background", "Foreground", "Orphan"])
def test_owner_reference_garbage_collection(client: Any, namespace: str, policy: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    owner = core.create_namespaced_config_map(namespace, _cm(namespace, "owner"))
    child = core.create_namespaced_config_map(namespace, _cm(namespace, "child", owner))
    core.create_namespaced_config_map(
        namespace, _cm(namespace, "grandchild", child, ["example.com/slow"])
    )
    core.delete_namespaced_config_map("owner", namespace, propagation_policy=policy)
    if policy == "Orphan":
        eventually(lambda: _exists(core, namespace, "owner") is None, what="owner gone")
        orphan = core.read_namespaced_config_map("child", namespace)
        assert not orphan.metadata.owner_references and orphan.metadata.deletion_timestamp is None
        return
    grandchild = eventually(lambda: _exists(core, namespace, "grandchild"), what="grandchild")
    eventually(
        lambda: (_exists(core, namespace, "grandchild") or grandchild).metadata.deletion_timestamp,
        what="grandchild deleting",
    )
    if policy == "Foreground":
        # Owner and child wait, marked, while a dependent (held by its own finalizer) remains.
        for name in ("owner", "child"):
            waiting = core.read_namespaced_config_map(name, namespace)
            assert (
                waiting.metadata.deletion_timestamp
                and "foregroundDeletion" in waiting.metadata.finalizers
            )
    else:
        eventually(lambda: _exists(core, namespace, "owner") is None, what="owner gone")
        eventually(lambda: _exists(core, namespace, "child") is None, what="child collected")
    core.patch_namespaced_config_map(
        "grandchild",
        namespace,
        {"metadata": {"finalizers": None}},
        _content_type="application/merge-patch+json",
    )
    for name in ("grandchild", "child", "owner"):
        eventually(_absent(core, namespace, name), what=f"{name} gone")


def test_namespace_deletion_removes_its_objects(client: Any) -> None:
    core: Any = k8s.CoreV1Api(client)
    core.create_namespace({"metadata": {"name": "doomed"}})
    core.create_namespaced_config_map("doomed", {"metadata": {"name": "a"}})
    core.delete_namespace("doomed")

    def gone() -> bool:
        try:
            core.read_namespace("doomed")
        except k8s.ApiException as error:
            return error.status == 404
        return False

    eventually(gone, what="namespace finalized")
    assert (
        core.list_config_map_for_all_namespaces(field_selector="metadata.namespace=doomed").items
        == []
    )


async def test_concurrent_watchers_each_see_every_event(
    cluster: LocalCluster, namespace: str
) -> None:
    """Fan-out under load loses nothing (a get() cancelled at a timeout once dropped events)."""
    import asyncio
    import ssl

    import aiohttp

    context = ssl.create_default_context(cafile=str(cluster.ca_path))
    headers = {"Authorization": f"Bearer {cluster.token}"}
    path = f"{cluster.api_url}/api/v1/namespaces/{namespace}/configmaps"
    watchers, events = 20, 40
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(ssl=context, limit=0), headers=headers
    ) as session:
        async with session.get(path) as response:
            since = (await response.json())["metadata"]["resourceVersion"]

        async def watch() -> list[str]:
            names: list[str] = []
            params = {"watch": "true", "resourceVersion": since, "timeoutSeconds": "60"}
            async with session.get(path, params=params) as response:
                async for line in response.content:
                    names.append(json.loads(line)["object"]["metadata"]["name"])
                    if len(names) == events:
                        return names
            return names

        tasks = [asyncio.create_task(watch()) for _ in range(watchers)]
        for index in range(events):
            async with session.post(path, json={"metadata": {"name": f"cm-{index}"}}) as response:
                assert response.status == 201
            if index % 10 == 0:
                await asyncio.sleep(0.3)  # let idle 'wait' timeouts interleave with events
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert all(names == [f"cm-{i}" for i in range(events)] for names in results)


def test_a_child_created_owned_by_a_gone_owner_is_collected_a_live_ones_is_not(
    client: Any, namespace: str
) -> None:
    """The collector skips writes whose owners all exist (a full pass looks at every object
    and every child is created owned); a child naming an owner that is gone (or going) is
    still collected, as on the real server."""
    core: Any = k8s.CoreV1Api(client)
    owner = core.create_namespaced_config_map(namespace, _cm(namespace, "owner"))
    core.delete_namespaced_config_map("owner", namespace)
    eventually(_absent(core, namespace, "owner"), what="owner gone")
    core.create_namespaced_config_map(namespace, _cm(namespace, "orphaned", owner))
    live = core.create_namespaced_config_map(namespace, _cm(namespace, "live"))
    core.create_namespaced_config_map(namespace, _cm(namespace, "kept", live))
    eventually(_absent(core, namespace, "orphaned"), what="the dangling child collected")
    assert _exists(core, namespace, "kept") is not None
