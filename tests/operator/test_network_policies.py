"""Per-run NetworkPolicies (issue 12: no NetworkPolicy was created).

Only the run's trainer reaches its Gyms' port; only its Gyms and trainer reach the
generation port; ``spec.network.metricsFrom`` adds the peers a user names. Each policy is a
valid Kubernetes object owned by the run, and the reconcile creates both with the run.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from rolloutrun_operator import builders, naming, network_policies, reconcile
from rolloutrun_operator.kube import PERMISSIONS, RESOURCES
from rolloutrun_runtime.contract.pod import TRAINER_METRICS_PORT
from tests.support.rolloutruns import make_run

K8S_VERSION = "1.33.0"
PROMETHEUS = {
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
}


def _roles(selector: dict[str, Any]) -> tuple[str, list[str]]:
    """The run and roles a member-pod selector admits (and nothing looser)."""
    (expression,) = selector["matchExpressions"]
    assert expression["key"] == naming.LABEL_ROLE and expression["operator"] == "In"
    assert set(selector["matchLabels"]) == {naming.LABEL_RUN}
    return selector["matchLabels"][naming.LABEL_RUN], expression["values"]


@pytest.mark.parametrize("network", [{}, {"metricsFrom": [PROMETHEUS, {}]}])
def test_policies_admit_only_the_run_and_its_metrics_peers(network: dict[str, Any]) -> None:
    run = make_run(network=network, gym={"port": 8123}, trainer={"generationPort": 8456})
    gym, generation = (
        network_policies.gym_network_policy(run),
        network_policies.generation_network_policy(run),
    )
    for policy in (gym, generation):
        kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
        assert policy["metadata"]["ownerReferences"] == [builders.owner_reference(run)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    expected_extra = [
        {k: v for k, v in peer.items()} if peer else {"podSelector": {"matchLabels": {}}}
        for peer in network.get("metricsFrom", [])
    ]

    assert _roles(gym["spec"]["podSelector"]) == ("demo", ["gym"])
    (rule,) = gym["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8123}]
    assert _roles(rule["from"][0]["podSelector"]) == ("demo", ["trainer"])
    assert "namespaceSelector" not in rule["from"][0]  # the run's own namespace only
    assert rule["from"][1:] == expected_extra

    assert _roles(generation["spec"]["podSelector"]) == ("demo", ["trainer"])
    rule, *metrics = generation["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8456}]
    assert _roles(rule["from"][0]["podSelector"]) == ("demo", ["gym", "trainer"])
    assert rule["from"][1:] == expected_extra
    # The trainer's /metrics port: only the metrics peers; without peers, no rule (an empty
    # "from" would admit every source).
    port = [{"protocol": "TCP", "port": TRAINER_METRICS_PORT}]
    assert metrics == ([{"from": expected_extra, "ports": port}] if expected_extra else [])


def test_the_run_creates_its_policies_and_the_operator_may() -> None:
    run = make_run()
    kinds = [kind for kind, _ in reconcile.static_child_refs(run)]
    assert kinds.count("NetworkPolicy") == 2
    assert RESOURCES["NetworkPolicy"].group == "networking.k8s.io"
    verbs = {
        v
        for g, r, vs in PERMISSIONS
        if (g, r) == ("networking.k8s.io", "networkpolicies")
        for v in vs
    }
    assert {"get", "create"} <= verbs


@pytest.mark.parametrize(
    ("selector", "problem"),
    [
        ({"matchLabels": {"bad key!": "x"}}, "is not a label key"),
        ({"matchLabels": {"app": "-x"}}, "is not a label value"),
    ],
)
def test_a_bad_metrics_selector_is_refused_by_name(selector: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        make_run(network={"metricsFrom": [{"podSelector": selector}]})


def _worker_run(name: str, generation_workers: int) -> Any:
    run = make_run(
        workers={"replicas": 2},
        trainer={"generationPort": 8456},
        run={"workers": {"backend": "ray", "generationWorkers": generation_workers}},
    )
    return run.model_copy(update={"metadata": {**run.metadata, "name": name}})


def _pods(run: Any) -> dict[str, Any]:
    from rolloutrun_operator.worker_pods import worker_pod

    return {
        "trainer": builders.trainer_pod(run, 1),
        "gym": builders.gym_pod(run, 1, 0),
        "worker": worker_pod(run, 1, 0, 0, "10.0.0.2"),
        "worker-1": worker_pod(run, 1, 1, 0, "10.0.0.2"),
    }


@pytest.mark.parametrize("generation_workers", [2, 6])
def test_only_the_runs_trainer_and_workers_reach_a_worker_pod_and_its_gyms_only_generation(
    generation_workers: int,
) -> None:
    """Decided by Kubernetes' rules (tests/support/network_policy.py: the local cluster does
    not enforce policies) over the pods the operator builds for two runs in one namespace:
    before, no policy selected a worker pod, so every pod reached every port of it."""
    from tests.support.network_policy import admits

    run, other = _worker_run("demo", generation_workers), _worker_run("other", 2)
    policy = network_policies.worker_network_policy(run)
    kubernetes_validate.validate(policy, K8S_VERSION, strict=True)
    assert policy["metadata"]["name"] == "demo-worker-ingress"
    assert policy["metadata"]["ownerReferences"] == [builders.owner_reference(run)]
    policies = [
        child
        for r in (run, other)
        for child in reconcile.static_children(r, token="t")
        if child["kind"] == "NetworkPolicy"
    ]
    ours, theirs = _pods(run), _pods(other)
    worker = ours["worker"]
    slots = generation_workers // 2  # generation ports on each worker node: one per slot
    ray_ports = (6379, 8456, 10002, 45123)  # the GCS, a generation port, Ray's dynamic ones
    for port in ray_ports:
        assert admits(policies, ours["trainer"], worker, port)  # the Ray head
        assert admits(policies, ours["worker-1"], worker, port)  # node to node
        assert admits(policies, ours["trainer"], theirs["worker"], port) is False
        for pod in theirs.values():  # no pod of another run reaches our worker
            assert admits(policies, pod, worker, port) is False
    generation = range(8456, 8456 + slots)
    assert all(admits(policies, ours["gym"], worker, port) for port in generation)
    for port in (6379, 8456 + slots, 8455, 45123):  # the Gyms reach no Ray port
        assert admits(policies, ours["gym"], worker, port) is False


def test_a_run_with_worker_pods_creates_their_policy() -> None:
    refs = reconcile.static_child_refs(_worker_run("demo", 2))
    assert ("NetworkPolicy", naming.worker_network_policy_name("demo")) in refs
    assert ("NetworkPolicy", "demo-worker-ingress") not in reconcile.static_child_refs(make_run())
