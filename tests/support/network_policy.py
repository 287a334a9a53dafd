"""Kubernetes' NetworkPolicy ingress decision, as a test oracle over built manifests.

Why here: the local cluster stores NetworkPolicies but does not enforce them (pods reach
each other on its bridge whatever the policies say, docs/local-cluster.md), so whether a
pod of another run can reach a run's worker pod is decided here by the API's rules: a pod
selected by no Ingress policy admits everything; a selected pod admits a connection that
some rule of a selecting policy admits (its ports, or all when it names none; its peers,
or all sources when it names none; a peer with only a podSelector is a pod of the policy's
namespace). Selectors are matched by the local cluster's own LabelSelector code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rolloutrun_localcluster.selectors import labels_match, selector_from_label_selector

Manifest = Mapping[str, Any]


def _selects(selector: Manifest | None, labels: Mapping[str, str]) -> bool:
    requirements = selector_from_label_selector(selector)
    return requirements is not None and labels_match(requirements, labels)


def _labels(pod: Manifest) -> Mapping[str, str]:
    return pod["metadata"].get("labels") or {}


def _peer_admits(peer: Manifest, source: Manifest, namespace: str) -> bool:
    if "ipBlock" in peer or "namespaceSelector" in peer:
        raise NotImplementedError("the oracle decides pod peers of one namespace only")
    same = (source["metadata"].get("namespace") or namespace) == namespace
    return same and _selects(peer.get("podSelector"), _labels(source))


def _port_admits(rule_ports: Iterable[Manifest] | None, port: int) -> bool:
    if not rule_ports:
        return True
    return any(
        entry.get("protocol", "TCP") == "TCP"
        and int(entry["port"]) <= port <= int(entry.get("endPort", entry["port"]))
        for entry in rule_ports
    )


def admits(policies: Iterable[Manifest], source: Manifest, target: Manifest, port: int) -> bool:
    """Whether ``source`` (a pod manifest) may open TCP ``port`` on ``target``."""
    namespace = target["metadata"].get("namespace") or "default"
    selecting = [
        policy
        for policy in policies
        if (policy["metadata"].get("namespace") or "default") == namespace
        and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        and _selects(policy["spec"]["podSelector"], _labels(target))
    ]
    if not selecting:
        return True
    return any(
        _port_admits(rule.get("ports"), port)
        and (
            not rule.get("from")
            or any(_peer_admits(peer, source, namespace) for peer in rule["from"])
        )
        for policy in selecting
        for rule in policy["spec"].get("ingress") or []
    )
