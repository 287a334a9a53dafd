"""The operator's API load does not grow with the trainers' renewals (issue 16).

Against the local cluster, which counts every admitted request by user: the operator
watches pods and Leases with the run label only; a renewal of the run's Lease with
unchanged annotations costs the operator no request; a progress annotation costs one status
patch; a foreign Lease renewing wakes nothing; and a Lease that stops being renewed still
expires and is acted on.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import pytest

from rolloutrun_localcluster.operator_access import ACCOUNT, NAMESPACE
from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import naming, watching
from rolloutrun_operator.handlers import RunMemory
from tests.support.kubectl import kubectl
from tests.support.operator_cluster import (
    GROUP,
    PLURAL,
    VERSION,
    RunNamespace,
    create_storage_claim,
    operator_thread,
    rolloutrun,
)

OPERATOR = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"


def micro_time() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ready(status: dict[str, Any]) -> tuple[str, str] | None:
    for item in status.get("conditions") or []:
        if item["type"] == "Ready":
            return item["status"], item.get("reason", "")
    return None


def operator_requests(cluster: Any) -> int:
    """The operator's requests so far, its Events left out (posted asynchronously)."""
    server = cluster.server
    return sum(
        count
        for (user, _verb, resource), count in list(server.requests.items())
        if user == OPERATOR and resource != "events"
    )


def test_renewals_cost_the_operator_nothing_and_an_expired_lease_still_acts(
    cluster, api, monkeypatch: pytest.MonkeyPatch
):
    from kubernetes import client as k8s

    monkeypatch.setattr(watching, "PROGRESS_MIRROR_SECONDS", 0.0)
    namespace = f"watch-{uuid.uuid4().hex[:6]}"
    core: Any = k8s.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    create_storage_claim(core, namespace)
    runs: Any = k8s.CustomObjectsApi(api)
    leases: Any = k8s.CoordinationV1Api(api)

    def status() -> dict[str, Any]:
        run = runs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w")
        return run.get("status") or {}

    def renew(name: str, holder: str, **notes: str) -> str:
        renewed = micro_time()
        spec = {"holderIdentity": holder, "renewTime": renewed, "leaseDurationSeconds": 3}
        patch = {"metadata": {"annotations": notes}, "spec": spec}
        leases.patch_namespaced_lease(name, namespace, patch)
        return renewed

    with operator_thread(cluster, namespace) as operator:

        def watched() -> set[tuple[str, str]]:
            opened = list(cluster.server.watch_selectors)
            return {(resource, selector) for user, resource, selector in opened if user == OPERATOR}

        def both() -> set[tuple[str, str]] | None:
            seen = watched()
            return seen if {"pods", "leases"} <= {resource for resource, _ in seen} else None

        selectors = eventually(both, what="the operator's watches")
        assert ("pods", "rolloutrun.dev/run") in selectors
        assert ("leases", "rolloutrun.dev/run") in selectors
        assert not {resource for resource, selector in selectors if not selector} & {
            "pods",
            "leases",
        }  # node heartbeats and foreign pods are never streamed
        runs.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, rolloutrun("w", gym_replicas=1, lease_seconds=3)
        )
        eventually(lambda: ready(status()) == ("True", "Running"), what="the run running")
        holder = "w-i1-trainer/1"
        memories: dict[tuple[str, str], RunMemory] = operator.memo["memories"]
        memory = eventually(lambda: memories.get((namespace, "w")), what="the run's memory")
        renew("w-trainer", holder)  # the trainer takes its Lease: a pass mirrors the holder
        eventually(lambda: (status().get("lease") or {}).get("holder") == holder, what="holder")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        # a foreign Lease (no run label), renewing beside it
        foreign = {"metadata": {"name": "node-heartbeat"}, "spec": {"holderIdentity": "node"}}
        leases.create_namespaced_lease(namespace, foreign)
        before, passes = operator_requests(cluster), memory.passes
        snapshot = dict(cluster.server.requests)
        for _ in range(5):
            renewed = renew("w-trainer", holder)
            renew("node-heartbeat", "node")
            eventually(lambda r=renewed: memory.lease and memory.lease.renew_time == r)
        made = {k: v - snapshot.get(k, 0) for k, v in cluster.server.requests.items()}
        made = {k: v for k, v in made.items() if v and k[0] == OPERATOR}
        assert operator_requests(cluster) == before, made  # renewals: no request at all
        assert memory.passes == passes
        # progress: one status patch, no pass
        renew("w-trainer", holder, **{"rolloutrun.dev/train-step": "7"})
        eventually(lambda: status().get("trainStep") == 7, what="the train step mirrored")
        made = {k: v - snapshot.get(k, 0) for k, v in cluster.server.requests.items()}
        made = {k[1:]: v for k, v in made.items() if v and k[0] == OPERATOR and k[2] != "events"}
        assert made == {("patch", "rolloutruns"): 1} and memory.passes == passes
        # the trainer stops renewing: its Lease expires on the operator's clock and is acted on
        eventually(
            lambda: (status().get("lastFailure") or {}).get("reason") == "LeaseExpired",
            what="the expired Lease acted on",
        )
        eventually(lambda: status().get("incarnation") == 2, what="the next incarnation")


def test_a_static_child_deleted_by_hand_is_recreated_without_waiting_for_the_resync(cluster, api):
    """``kubectl delete`` of the run's Service, NetworkPolicy and member Role: the
    label-selected watches of static children (under the chart's rules) make a pass due, and
    it recreates them; without them nothing would look before the 20-minute resync (the
    stand-in trainer never takes its Lease, so no Lease event wakes the run either)."""
    from kubernetes import client as k8s

    ns = RunNamespace(api, "static")
    network: Any = k8s.NetworkingV1Api(api)
    children = {
        "service": (naming.trainer_service_name("s"), ns.core.read_namespaced_service),
        "networkpolicy": (
            naming.gym_network_policy_name("s"),
            network.read_namespaced_network_policy,
        ),
        "role": (naming.member_account_name("s"), ns.rbac.read_namespaced_role),
    }

    def uid(read: Any, name: str) -> str | None:
        try:
            return str(read(name, ns.name).metadata.uid)
        except k8s.ApiException as error:
            if error.status == 404:
                return None
            raise

    with operator_thread(cluster, ns.name) as operator:
        ns.create_run(rolloutrun("s", gym_replicas=1, lease_seconds=30))
        eventually(lambda: ns.ready_condition("s").get("reason") == "Running", what="running")
        memories: dict[tuple[str, str], RunMemory] = operator.memo["memories"]
        memory = eventually(lambda: memories.get((ns.name, "s")), what="the run's memory")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        before = {kind: uid(read, name) for kind, (name, read) in children.items()}
        assert None not in before.values(), before
        for kind, (name, _read) in children.items():
            kubectl(cluster, "delete", kind, name, namespace=ns.name)
        for kind, (name, read) in children.items():
            again = eventually(lambda r=read, n=name: uid(r, n), what=f"{kind} {name} recreated")
            assert again != before[kind]


def test_a_steady_pass_reads_the_static_children_from_the_indexes(cluster, api):
    """A pass of a running run (woken by an annotation of the run) reads its ConfigMap,
    Services, NetworkPolicies, RBAC and Lease from the Kopf indexes of their watches: no GET
    of those kinds (issue 16: a pass cost about fourteen requests, one GET per child)."""
    from kubernetes import client as k8s

    ns = RunNamespace(api, "indexed")
    runs: Any = k8s.CustomObjectsApi(api)
    with operator_thread(cluster, ns.name) as operator:
        ns.create_run(rolloutrun("x", gym_replicas=1, lease_seconds=30))
        eventually(lambda: ns.ready_condition("x").get("reason") == "Running", what="running")
        memories: dict[tuple[str, str], RunMemory] = operator.memo["memories"]
        memory = eventually(lambda: memories.get((ns.name, "x")), what="the run's memory")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        snapshot, passes = dict(cluster.server.requests), memory.passes
        for poke in range(2):  # the first pass may still read what the last one wrote
            patch = {"metadata": {"annotations": {"test/poke": str(poke)}}}
            runs.patch_namespaced_custom_object(GROUP, VERSION, ns.name, PLURAL, "x", patch)
            eventually(lambda n=passes: memory.passes > n, what="a pass")
            eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
            snapshot, passes = dict(cluster.server.requests), memory.passes
        patch = {"metadata": {"annotations": {"test/poke": "last"}}}
        runs.patch_namespaced_custom_object(GROUP, VERSION, ns.name, PLURAL, "x", patch)
        eventually(lambda: memory.passes > passes, what="a steady pass")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        made = {k: v - snapshot.get(k, 0) for k, v in cluster.server.requests.items()}
        made = {k[1:]: v for k, v in made.items() if v and k[0] == OPERATOR and k[2] != "events"}
        indexed = {"configmaps", "services", "serviceaccounts", "roles", "rolebindings"}
        indexed |= {"networkpolicies", "leases", "pods"}
        assert not [key for key in made if key[0] in ("get", "list") and key[1] in indexed], made
        # nor of the run: the pass starts from the run as its watch event showed it, which
        # shows the last status write (a lost pod's reaction saves that round trip)
        assert ("get", "rolloutruns") not in made, made


def test_a_lost_pods_reaction_reads_its_secrets_and_nodes_once(cluster, api):
    """A lost trainer's reaction is a few passes within a second or two (delete the old
    members, see them go, start the next incarnation): only the first reads the token
    Secrets and the node from the API, those after it take what it read moments ago
    (issue 16: the replacing pass spent 1.94 s in such reads before it acted, at 1,000
    runs). A running member's node is still read by every pass."""
    from kubernetes import client as k8s

    ns = RunNamespace(api, "reads")
    with operator_thread(cluster, ns.name) as operator:
        ns.create_run(rolloutrun("l", gym_replicas=1, lease_seconds=30))
        eventually(lambda: ns.ready_condition("l").get("reason") == "Running", what="running")
        memories: dict[tuple[str, str], RunMemory] = operator.memo["memories"]
        memory = eventually(lambda: memories.get((ns.name, "l")), what="the run's memory")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        snapshot, passes = dict(cluster.server.requests), memory.passes
        core: Any = k8s.CoreV1Api(api)
        core.delete_namespaced_pod("l-i1-trainer", ns.name, grace_period_seconds=0)
        eventually(lambda: ns.run("l").get("status", {}).get("incarnation") == 2, what="i2")
        eventually(lambda: not (memory.dirty or memory.busy), what="the pass done")
        made = {k: v - snapshot.get(k, 0) for k, v in cluster.server.requests.items()}
        made = {k[1:]: v for k, v in made.items() if v and k[0] == OPERATOR and k[2] != "events"}
        assert memory.passes >= passes + 2, (memory.passes, passes)  # a reaction of passes
        tokens = len([ref for ref in memory.read if ref.startswith("Secret/")])
        assert tokens >= 2, memory.read  # the run's token Secrets, read once
        assert made.get(("get", "secrets"), 0) <= tokens, made
