"""Generation-worker pods: built to join the trainer's Ray head, created once the trainer
has an address, a lost one replaced under its index (next member generation, counted as a
worker replacement) while the incarnation goes on, and gone with the trainer."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from rolloutrun_operator import builders, naming
from rolloutrun_operator.api.validation import RolloutRunInvalid
from rolloutrun_operator.network_policies import generation_network_policy
from rolloutrun_operator.observe import PodView
from rolloutrun_operator.reconcile import reconcile
from rolloutrun_operator.worker_pods import worker_pod
from rolloutrun_runtime.contract.pod import (
    LABEL_WORKER_INDEX,
    RAY_GCS_PORT,
    worker_pod_name,
)
from tests.support.rolloutruns import NOW, RUN, gym, make_run, observed, running_status, trainer

GEN = naming.LABEL_MEMBER_GENERATION
WORKERS = {"replicas": 2, "resources": {"limits": {"memory": "8Gi", "cpu": "2"}}}
RAY_RUN = {"workers": {"backend": "ray", "generationWorkers": 4}}


def run_with_workers(status: dict[str, Any] | None = None, **workers: Any):
    return make_run(status, workers={**WORKERS, **workers}, run=RAY_RUN)


def worker(incarnation: int, index: int, **fields: Any) -> PodView:
    defaults: dict[str, Any] = {"phase": "Running", "pod_ip": f"127.0.0.{30 + index}"}
    return PodView(
        name=worker_pod_name(RUN, incarnation, index),
        role="worker",
        incarnation=incarnation,
        worker_index=index,
        **{**defaults, **fields},
    )


def creates(result) -> list[tuple[str, str]]:
    return sorted(
        (a.name, a.manifest["metadata"]["labels"][GEN])
        for a in result.actions
        if str(a).startswith("create Pod/")
    )


def again(result):
    return run_with_workers(result.status.model_dump(by_alias=True, mode="json"))


def test_a_worker_pod_joins_the_trainers_head_with_generation_slots_and_a_memory_shm():
    pod = worker_pod(run_with_workers(), 3, 1, 2, "10.4.0.7")
    labels = pod["metadata"]["labels"]
    assert pod["metadata"]["name"] == "demo-i3-worker-1"
    assert (labels[naming.LABEL_ROLE], labels[LABEL_WORKER_INDEX], labels[GEN]) == (
        "worker",
        "1",
        "2",
    )
    [container] = pod["spec"]["containers"]
    assert container["command"][-2:] == [f"--address=10.4.0.7:{RAY_GCS_PORT}", "--slots=2"]
    assert container["image"] == make_run().spec.images.trainer  # one Ray, one Python
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}  # KubeRay's sizing
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert naming.ENV_GYM_TOKEN in {e["name"] for e in container["env"]}  # Ray auth
    no_limit = worker_pod(run_with_workers(resources={}), 1, 0, 0, "10.4.0.7")
    assert next(v for v in no_limit["spec"]["volumes"] if v["name"] == "shm")["emptyDir"] == {
        "medium": "Memory"
    }


def test_the_trainer_config_places_actors_on_the_worker_nodes():
    rendered = builders.render_run_config(run_with_workers())
    assert rendered.workers.worker_nodes == 2
    assert builders.render_run_config(make_run()).workers.worker_nodes == 0


def test_workers_default_to_the_trainer_pod_and_need_ray():
    assert make_run().spec.workers.replicas == 0
    with pytest.raises(RolloutRunInvalid, match="backend 'ray'"):
        make_run(workers={"replicas": 1}, run={"workers": {"backend": "inprocess"}})
    with pytest.raises(RolloutRunInvalid, match="rayAddress"):
        make_run(workers={"replicas": 1}, run={"workers": {"rayAddress": "head:6379"}})


def test_the_trainer_admits_its_worker_pods_on_every_port():
    ingress = generation_network_policy(run_with_workers())["spec"]["ingress"]
    assert any(
        rule["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["worker"]
        and "ports" not in rule
        for rule in ingress
    )
    plain = generation_network_policy(make_run())["spec"]["ingress"]
    assert all("ports" in rule for rule in plain)


def test_worker_pods_wait_for_the_trainers_address_then_join_it():
    pods = (trainer(1, pod_ip=None), gym(1, 0), gym(1, 1))
    waiting = reconcile(run_with_workers(running_status()), observed(pods), NOW)
    assert creates(waiting) == []
    result = reconcile(run_with_workers(running_status()), observed(members_with()), NOW)
    assert creates(result) == [("demo-i1-worker-0", "0"), ("demo-i1-worker-1", "0")]
    command = result.actions[0].manifest["spec"]["containers"][0]["command"]
    assert f"--address=127.0.0.2:{RAY_GCS_PORT}" in command
    assert result.status.member_replacements == [] and result.status.members == []


def members_with(*workers: PodView) -> tuple[PodView, ...]:
    return (trainer(1), gym(1, 0), gym(1, 1), *workers)


def replaced_members(result) -> list[tuple[str, int, int]]:
    """The members past their first pod (the others are only recorded as seen)."""
    return [(m.role, m.index, m.generation) for m in result.status.members if m.generation]


def test_a_worker_pod_that_vanished_unseen_is_replaced_and_counted():
    """Deleted with grace 0 (or its node lost and its pods removed), a worker pod is gone
    before any pass sees it going: it is a loss all the same, replaced under the next
    generation and counted, not taken for a pod never created (before: generation 0 again,
    and no replacement counted, so ``memberReplacements`` missed every node loss)."""
    seen = reconcile(
        run_with_workers(running_status()), observed(members_with(worker(1, 0), worker(1, 1))), NOW
    )
    assert [(m.role, m.index, m.generation) for m in seen.status.members] == [
        ("worker", 0, 0),
        ("worker", 1, 0),
    ]
    vanished = reconcile(again(seen), observed(members_with(worker(1, 1))), NOW)
    assert creates(vanished) == [("demo-i1-worker-0", "1")]
    later = NOW + dt.timedelta(seconds=3)
    new = worker(1, 0, generation=1, ready=True)
    done = reconcile(again(vanished), observed(members_with(new, worker(1, 1))), later)
    [record] = done.status.member_replacements
    assert (record.role, record.count, record.last_seconds) == ("worker", 1, 3.0)


def test_a_lost_worker_is_replaced_under_its_index_and_counted():
    going = members_with(worker(1, 0, deletion_time=NOW), worker(1, 1))
    lost = reconcile(run_with_workers(running_status()), observed(going), NOW)
    assert lost.status.incarnation == 1 and lost.status.restarts == 0
    assert replaced_members(lost) == [("worker", 0, 1)]
    gone = reconcile(again(lost), observed(members_with(worker(1, 1))), NOW)
    assert creates(gone) == [("demo-i1-worker-0", "1")]
    later = NOW + dt.timedelta(seconds=4)
    new = worker(1, 0, generation=1, ready=True)
    done = reconcile(again(gone), observed(members_with(new, worker(1, 1))), later)
    [record] = done.status.member_replacements
    assert (record.role, record.count, record.last_seconds) == ("worker", 1, 4.0)
    assert creates(done) == []


def test_a_failed_worker_pod_is_replaced_not_the_run():
    failed = worker(1, 1, phase="Failed", exit_code=1)
    pods = members_with(worker(1, 0), failed)
    result = reconcile(run_with_workers(running_status()), observed(pods), NOW)
    assert result.status.incarnation == 1
    assert replaced_members(result) == [("worker", 1, 1)]


def test_a_lost_trainer_ends_the_incarnation_with_its_workers():
    lost = trainer(1, phase="Failed", exit_code=1)
    pods = (lost, gym(1, 0), gym(1, 1), worker(1, 0), worker(1, 1))
    result = reconcile(run_with_workers(running_status()), observed(pods), NOW)
    stopped = {a.name for a in result.actions if str(a).startswith("delete Pod/")}
    assert {"Pod/demo-i1-worker-0", "Pod/demo-i1-worker-1"} <= {f"Pod/{n}" for n in stopped}
    assert result.status.incarnation_start_time is None


def test_worker_pods_do_not_keep_a_run_from_ready():
    pods = members_with(worker(1, 0, ready=True), worker(1, 1, ready=True))
    result = reconcile(run_with_workers(running_status()), observed(pods), NOW)
    ready = next(c for c in result.status.conditions if c.type == "Ready")
    assert (ready.status.value, ready.reason) == ("True", "Running")


def test_without_elastic_members_a_lost_worker_ends_the_incarnation():
    run = make_run(
        running_status(),
        workers=WORKERS,
        run=RAY_RUN,
        recovery={"elasticMembers": False},
    )
    going = members_with(worker(1, 0, deletion_time=NOW), worker(1, 1))
    result = reconcile(run, observed(going), NOW)
    assert result.status.incarnation_start_time is None and result.status.members == []


def test_standby_worker_pods_are_kept_beside_the_workers_and_counted_alike():
    """``spec.workers.standby``: that many more worker pods, alike (which serve is the
    trainer's), their actors counted as standbys in the trainer's config; a lost standby pod
    is replaced under its index like any worker, one replacement."""
    run = run_with_workers(running_status(), standby=1)
    result = reconcile(run, observed(members_with()), NOW)
    assert creates(result) == [
        ("demo-i1-worker-0", "0"),
        ("demo-i1-worker-1", "0"),
        ("demo-i1-worker-2", "0"),
    ]
    standby_pod = next(a.manifest for a in result.actions if a.name == "demo-i1-worker-2")
    assert "--slots=2" in standby_pod["spec"]["containers"][0]["command"]  # a worker's slots
    rendered = builders.render_run_config(run)
    assert (rendered.workers.worker_nodes, rendered.workers.standby_workers) == (2, 2)
    assert builders.render_run_config(run_with_workers()).workers.standby_workers == 0
    pods = members_with(worker(1, 0), worker(1, 1), worker(1, 2, deletion_time=NOW))
    lost = reconcile(run_with_workers(running_status(), standby=1), observed(pods), NOW)
    assert replaced_members(lost) == [("worker", 2, 1)]
    assert lost.status.incarnation == 1


def test_standby_needs_worker_pods():
    assert make_run().spec.workers.standby == 0
    with pytest.raises(RolloutRunInvalid, match=r"workers.standby needs workers.replicas > 0"):
        make_run(workers={"standby": 1}, run=RAY_RUN)
