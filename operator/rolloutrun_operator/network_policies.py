"""Pure builders of a run's NetworkPolicies (split from builders.py: one concern, one module).

Network: two NetworkPolicies per run admit, on the Gym port, only the run's trainer and, on
the generation port, only its Gyms and trainer (plus ``spec.network.metricsFrom``); only the
metrics peers reach the trainer's ``/metrics`` port. With worker pods (``spec.workers``) a
third admits to them only the run's trainer (the Ray head) and its other worker pods, on
every port (Ray's node-to-node traffic: raylet, object manager and worker ports, several
dynamic), and its Gyms on the worker nodes' generation ports only. They select by the run's
labels; the bearer token each server checks (and Ray's token) is what authenticates.
"""

from __future__ import annotations

from rolloutrun_operator import naming
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.builders import Manifest, metadata, run_name
from rolloutrun_runtime.contract.pod import TRAINER_METRICS_PORT, generation_slots


def _member_pods(run: RolloutRun, *roles: str) -> Manifest:
    """A selector of this run's member pods in ``roles``."""
    return {
        "matchLabels": {naming.LABEL_RUN: run_name(run)},
        "matchExpressions": [{"key": naming.LABEL_ROLE, "operator": "In", "values": sorted(roles)}],
    }


def _metrics_peers(run: RolloutRun) -> list[Manifest]:
    peers: list[Manifest] = []
    for peer in run.spec.network.metrics_from:
        entry: Manifest = {"podSelector": {"matchLabels": dict(peer.pod_selector.match_labels)}}
        if peer.namespace_selector is not None:
            entry["namespaceSelector"] = {"matchLabels": dict(peer.namespace_selector.match_labels)}
        peers.append(entry)
    return peers


def _ingress_policy(run: RolloutRun, name: str, to: str, port: int, *clients: str) -> Manifest:
    """Ingress to the run's ``to`` pods: only the run's ``clients`` pods (and the metrics
    peers of ``spec.network.metricsFrom``) on ``port``; everything else is dropped."""
    peers = [{"podSelector": _member_pods(run, *clients)}, *_metrics_peers(run)]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(run, name),
        "spec": {
            "podSelector": _member_pods(run, to),
            "policyTypes": ["Ingress"],
            "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def gym_network_policy(run: RolloutRun) -> Manifest:
    """Only the run's trainer (and the metrics peers) reaches its Gyms' port."""
    return _ingress_policy(
        run,
        naming.gym_network_policy_name(run_name(run)),
        naming.Role.GYM,
        run.spec.gym.port,
        naming.Role.TRAINER,
    )


def generation_network_policy(run: RolloutRun) -> Manifest:
    """Only the run's Gyms and trainer (and the metrics peers) reach the generation port;
    only the metrics peers reach the trainer's ``/metrics`` port (no peers: no one)."""
    policy = _ingress_policy(
        run,
        naming.generation_network_policy_name(run_name(run)),
        naming.Role.TRAINER,
        run.spec.trainer.generation_port,
        naming.Role.GYM,
        naming.Role.TRAINER,
    )
    if run.spec.workers.replicas:  # worker pods are Ray nodes of the trainer's head: Ray's
        # GCS and raylet ports (several of them dynamic), all from the run's worker pods only
        worker_pods = {"podSelector": _member_pods(run, naming.Role.WORKER)}
        policy["spec"]["ingress"].append({"from": [worker_pods]})
    peers = _metrics_peers(run)
    if peers:  # an empty "from" would admit every source
        policy["spec"]["ingress"].append(
            {"from": peers, "ports": [{"protocol": "TCP", "port": TRAINER_METRICS_PORT}]}
        )
    return policy


def worker_network_policy(run: RolloutRun) -> Manifest:
    """Only the run's trainer and worker pods reach a worker pod (every port: Ray's
    node-to-node traffic), and its Gyms only the generation ports there: the pod's
    generation port and the next, one per generation slot the node offers (where the
    generation actors serve)."""
    port = run.spec.trainer.generation_port
    slots = generation_slots(run.spec.run.workers.generation_workers, run.spec.workers.replicas)
    ports: Manifest = {"protocol": "TCP", "port": port}
    if slots > 1:
        ports["endPort"] = port + slots - 1
    ray_peers = {"podSelector": _member_pods(run, naming.Role.TRAINER, naming.Role.WORKER)}
    gyms = {"podSelector": _member_pods(run, naming.Role.GYM)}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(run, naming.worker_network_policy_name(run_name(run))),
        "spec": {
            "podSelector": _member_pods(run, naming.Role.WORKER),
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [ray_peers]}, {"from": [gyms], "ports": [ports]}],
        },
    }
