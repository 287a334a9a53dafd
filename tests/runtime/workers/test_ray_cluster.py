"""The pure parts of the trainer's place in a Ray cluster: addresses, node arguments and
where the generation actors go."""

from __future__ import annotations

import json

import pytest

from rolloutrun_runtime.contract.pod import (
    RAY_GCS_PORT,
    RAY_GENERATION_RESOURCE,
    generation_slots,
    ray_worker_node_argv,
)
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.workers.ray_cluster import (
    AddressKind,
    RayClusterError,
    actor_resources,
    head_argv,
    member_argv,
    parse_address,
)


def test_a_gcs_address_and_a_client_address_are_told_apart() -> None:
    gcs = parse_address("raycluster-head-svc.ns.svc:6379")
    assert (gcs.kind, gcs.host, gcs.port, gcs.gcs) == (
        AddressKind.GCS,
        "raycluster-head-svc.ns.svc",
        6379,
        "raycluster-head-svc.ns.svc:6379",
    )
    client = parse_address("ray://10.0.0.5:10001")
    assert (client.kind, client.host, client.port) == (AddressKind.CLIENT, "10.0.0.5", 10001)


@pytest.mark.parametrize("bad", ["", "head", "head:", ":6379", "head:99999", "http://h:1"])
def test_a_bad_ray_address_is_refused_by_name(bad: str) -> None:
    with pytest.raises(RayClusterError, match=r"workers\.rayAddress"):
        parse_address(bad)


def test_the_head_binds_the_pod_address_with_the_fixed_gcs_port() -> None:
    argv = head_argv("10.1.2.3")
    assert "--head" in argv and "--block" in argv
    assert "--node-ip-address=10.1.2.3" in argv and f"--port={RAY_GCS_PORT}" in argv
    assert not any(RAY_GENERATION_RESOURCE in a for a in argv)  # no actor on the head
    # no idle workers prestarted on the trainer's node, no log monitor tailing for nobody
    assert "--num-cpus=0" in argv and "--include-log-monitor=false" in argv
    joined = member_argv("head:6379", "10.1.2.4")
    assert "--address=head:6379" in joined and "--num-cpus=0" in joined


def test_worker_nodes_offer_generation_slots_and_actors_ask_for_one() -> None:
    argv = ray_worker_node_argv("10.1.2.3:6379", "10.1.2.9", 2)
    resources = next(a for a in argv if a.startswith("--resources="))
    assert json.loads(resources.split("=", 1)[1]) == {RAY_GENERATION_RESOURCE: 2}
    assert "--include-log-monitor=false" in argv  # the driver takes no worker logs
    assert generation_slots(5, 2) == 3 and generation_slots(2, 2) == 1
    with pytest.raises(ValueError):
        generation_slots(2, 0)
    placed = RunConfig.model_validate({"workers": {"workerNodes": 2}})
    assert actor_resources(placed) == {RAY_GENERATION_RESOURCE: 1.0}
    assert actor_resources(RunConfig()) == {}  # no worker nodes: beside the trainer


def test_the_cluster_authenticates_with_a_token_derived_from_the_runs():
    from rolloutrun_runtime.contract.pod import ray_auth_token
    from rolloutrun_runtime.workers.ray_cluster import node_env

    derived = ray_auth_token("run-secret")
    assert derived == ray_auth_token("run-secret") and "run-secret" not in derived
    env = node_env({"PATH": "/bin"}, auth_token=derived)
    assert (env["RAY_AUTH_MODE"], env["RAY_AUTH_TOKEN"]) == ("token", derived)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1"  # 0 refuses worker nodes
    chosen = node_env({"RAY_AUTH_MODE": "disabled"}, auth_token=derived)
    assert chosen["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in chosen


def test_the_actors_gpus_are_read_from_the_joined_worker_nodes_only() -> None:
    from rolloutrun_runtime.workers.ray_placement import generation_gpus

    def node(alive: bool = True, gpus: float = 0.0, slots: float = 0.0) -> dict[str, object]:
        resources = {"CPU": 1.0, "GPU": gpus, RAY_GENERATION_RESOURCE: slots}
        return {"Alive": alive, "Resources": {k: v for k, v in resources.items() if v}}

    head = node(gpus=8)  # the trainer's own GPUs are not the actors'
    one = node(gpus=1, slots=1)
    assert generation_gpus([head], 2) is None  # the worker nodes have not joined yet
    assert generation_gpus([head, one], 2) is None
    assert generation_gpus([head, one, node(alive=False, gpus=1, slots=1)], 2) is None
    assert generation_gpus([head, one, node(gpus=1, slots=1)], 2) == 2.0
    assert generation_gpus([head, one, node(slots=1)], 2) == 1.0
    assert generation_gpus([head], 0) == 0.0
    argv = ray_worker_node_argv("10.1.2.3:6379", "10.1.2.9", 1, num_gpus=1)
    assert argv[-1] == "--num-gpus=1"


def test_actors_on_worker_nodes_serve_on_the_nodes_generation_ports() -> None:
    from rolloutrun_runtime.workers.ray_placement import candidate_ports, node_ports

    cfg = RunConfig.model_validate({"workers": {"generationWorkers": 5, "workerNodes": 2}})
    assert node_ports(cfg) == 3  # slots per node: the span the worker policy admits Gyms to
    assert candidate_ports(8100, 3) == [8100, 8101, 8102, 0]  # then any free port
    assert candidate_ports(0, 3) == [0]  # no generation port (outside a pod): any
