"""The Kopf handlers over real HTTP against the local cluster: children, endpoints, status,
recovery after a deleted pod, lease mirroring and expiry, suspend and resume.

Member pods run a stand-in ``rolloutrun`` (first on the pods' PATH) that records its argv
and sleeps: this test is about the operator; runs with the real trainer and Gym come with
the embedded ``rolloutrun run``.
"""

from __future__ import annotations

import base64
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutrun_localcluster.operator_access import operator_kubeconfig
from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import naming
from rolloutrun_operator.handlers import MAX_IDLE_SECONDS, next_pass_delay
from rolloutrun_operator.kube import permission_rules
from rolloutrun_runtime.coordination import FencedError, KubernetesLease
from tests.support.operator_cluster import (
    GROUP,
    PLURAL,
    VERSION,
    RunNamespace,
    operator_thread,
    rolloutrun,
)


def test_a_pass_asking_to_look_again_at_once_is_not_left_idle():
    # 0 is a preemption's restart or an elapsed backoff: the next pass runs at once
    assert next_pass_delay(0.0) == 0.0
    assert next_pass_delay(None) == MAX_IDLE_SECONDS
    assert next_pass_delay(2.5) == 2.5 and next_pass_delay(1e6) == MAX_IDLE_SECONDS


def test_the_operator_runs_recovers_mirrors_and_suspends(cluster, api):
    ns = RunNamespace(api, "op")
    namespace, core, runs = ns.name, ns.core, ns.runs

    def run() -> dict[str, Any]:
        return runs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "demo")

    def status() -> dict[str, Any]:
        return run().get("status") or {}

    def condition(kind: str) -> tuple[str, str] | None:
        for item in status().get("conditions") or []:
            if item["type"] == kind:
                return item["status"], item.get("reason", "")
        return None

    def pods() -> dict[str, Any]:
        items = core.list_namespaced_pod(namespace, label_selector="rolloutrun.dev/run=demo").items
        return {pod.metadata.name: pod for pod in items}

    def running(*names: str) -> bool:
        now = pods()
        return all(n in now and now[n].status.phase == "Running" for n in names)

    with operator_thread(cluster, namespace) as operator:
        runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rolloutrun("demo"))
        eventually(lambda: condition("Ready") == ("True", "Running"), what="run ready")
        members = pods()
        assert set(members) == {"demo-i1-trainer", "demo-i1-gym-0", "demo-i1-gym-1"}
        gyms = [members[f"demo-i1-gym-{i}"] for i in range(2)]
        config = core.read_namespaced_config_map("demo-config", namespace)
        trainer_config = yaml.safe_load(config.data["run.yaml"])
        assert trainer_config["gym"]["endpoints"] == [
            f"http://{pod.status.pod_ip}:8000" for pod in gyms
        ]
        assert trainer_config["checkpointing"]["storageUri"] == "file:///tmp/rolloutrun-test"
        gym_token = core.read_namespaced_secret("demo-gym-token", namespace).data["token"]
        metrics = core.read_namespaced_secret("demo-metrics-token", namespace)
        assert metrics.data["token"] and metrics.data["token"] != gym_token
        assert metrics.metadata.owner_references[0].name == "demo"
        assert core.read_namespaced_service("demo-trainer", namespace).spec.ports[0].port == 8100
        lease_obj = ns.leases.read_namespaced_lease("demo-trainer", namespace)
        assert lease_obj.metadata.owner_references[0].name == "demo"
        from kubernetes import client as k8s

        policies: Any = k8s.NetworkingV1Api(api)
        for name, port in (("demo-gym-ingress", 8000), ("demo-generation-ingress", 8100)):
            policy = policies.read_namespaced_network_policy(name, namespace)
            assert policy.metadata.owner_references[0].name == "demo"
            assert policy.spec.ingress[0].ports[0].port == port
        argv = Path(cluster.pod_dir(namespace, "demo-i1-gym-1") or "") / "argv"
        eventually(argv.exists, what="the gym stand-in started")
        assert argv.read_text().split() == [
            "gym", "--config", "/etc/rolloutrun/run.yaml", "--host", gyms[1].status.pod_ip,
            "--port", "8000",
            "--instance-id", "demo-gym-1",
            "--audit-file", "/tmp/rolloutrun-test/gym-audit/gym-1.audit.jsonl",
        ]  # fmt: skip
        current = status()
        assert current["incarnation"] == 1 and current["observedGeneration"] == 1

        # A deleted Gym pod is replaced under its name, generation 1: incarnation 1 goes on.
        old_uid = members["demo-i1-gym-0"].metadata.uid
        core.delete_namespaced_pod("demo-i1-gym-0", namespace)

        def replaced() -> bool:
            pod = pods().get("demo-i1-gym-0")
            return bool(pod and pod.metadata.uid != old_uid and pod.status.phase == "Running")

        eventually(replaced, what="gym 0 replaced")
        assert pods()["demo-i1-gym-0"].metadata.labels[naming.LABEL_MEMBER_GENERATION] == "1"
        assert pods()["demo-i1-trainer"].metadata.uid == members["demo-i1-trainer"].metadata.uid
        eventually(
            lambda: (status().get("memberReplacements") or [{}])[0].get("count") == 1,
            what="the replacement counted",
        )
        current = status()
        assert current["incarnation"] == 1 and current["preemptions"] == 0
        assert current["memberReplacements"][0]["role"] == "gym"
        new_ip = pods()["demo-i1-gym-0"].status.pod_ip
        key = naming.member_endpoints_annotation("gym")

        def lease_endpoints() -> dict[int, Any]:
            notes = ns.leases.read_namespaced_lease("demo-trainer", namespace).metadata
            return naming.parse_member_endpoints((notes.annotations or {}).get(key), 1)

        eventually(lambda: 0 in lease_endpoints(), what="the replacement's address on the Lease")
        assert lease_endpoints()[0] == naming.MemberEndpoint(0, f"http://{new_ip}:8000", 1)

        # A deleted trainer ends incarnation 1.
        core.delete_namespaced_pod("demo-i1-trainer", namespace)
        eventually(lambda: status().get("incarnation") == 2, what="incarnation 2")
        eventually(lambda: condition("Ready") == ("True", "Running"), what="incarnation 2 ready")
        assert running("demo-i2-trainer", "demo-i2-gym-0", "demo-i2-gym-1")
        eventually(lambda: not [n for n in pods() if "-i1-" in n], what="incarnation 1 gone")
        current = status()
        assert (current["preemptions"], current["restarts"]) == (1, 0)
        assert current["lastFailure"]["reason"] == "PodDeleted"
        assert current["members"] == []

        # The trainer of incarnation 2 holds the lease and reports progress: mirrored.
        trainer = KubernetesLease(
            "demo-trainer", namespace, "demo-i2-trainer/2", 2, api_client=api, duration_seconds=2
        )
        trainer.acquire(timeout=30)
        trainer.record_progress(
            train_step=7, anchor_step=5, latest_manifest="file:///tmp/rolloutrun-test/m7.json"
        )
        eventually(lambda: status().get("trainStep") == 7, what="train step mirrored")
        assert status()["latestManifestUri"] == "file:///tmp/rolloutrun-test/m7.json"
        assert status()["anchorStep"] == 5

        # It stops renewing (hung): the operator acts on the expired lease.
        eventually(lambda: status().get("incarnation") == 3, what="incarnation 3 after expiry")
        assert status()["lastFailure"]["reason"] == "LeaseExpired"
        assert status()["restarts"] == 1
        with pytest.raises(FencedError):
            trainer.ensure_held()
        eventually(
            lambda: (
                "m7.json"
                in core.read_namespaced_config_map("demo-config", namespace).data.get(
                    "run.yaml", ""
                )
            ),
            what="incarnation 3 resumes from the manifest",
        )

        # Suspend: pods gone, Suspended; resume starts incarnation 4.
        runs.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "demo", {"spec": {"suspend": True}}
        )
        eventually(lambda: condition("Suspended") == ("True", "Suspended"), what="suspended")
        assert pods() == {}
        runs.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "demo", {"spec": {"suspend": False}}
        )
        eventually(lambda: condition("Ready") == ("True", "Running"), what="resumed")
        assert status()["incarnation"] == 4 and status()["restarts"] == 1
        events = core.list_namespaced_event(namespace).items
        reasons = {event.reason for event in events}
        assert {"IncarnationStarting", "PodDeleted", "LeaseExpired", "Suspended"} <= reasons
        # What the schema (and its CEL rules) cannot reject becomes a condition, and a fixed
        # spec runs: a claim mounted over the pods' own /tmp.
        bad = rolloutrun("bad")
        bad["spec"]["storage"]["uri"] = "file:///tmp"
        runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)

        def bad_ready() -> tuple[str, str, str] | None:
            found = runs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "bad")
            for item in (found.get("status") or {}).get("conditions") or []:
                if item["type"] == "Ready":
                    return item["status"], item["reason"], item.get("message", "")
            return None

        eventually(lambda: (bad_ready() or ("",))[0] == "False", what="invalid spec reported")
        _status, reason, message = bad_ready() or ("", "", "")
        assert reason == "InvalidSpec" and "mounted over the pods' own '/tmp'" in message
        fixed = {"spec": {"storage": {"uri": "file:///tmp/rolloutrun-test"}}}
        runs.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "bad", fixed)
        eventually(lambda: (bad_ready() or ("", ""))[1] != "InvalidSpec", what="fixed spec runs")
        runs.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "bad")
        eventually(
            lambda: (
                not [n for n in pods() if n.startswith("bad-")]
                and not core.list_namespaced_pod(
                    namespace, label_selector="rolloutrun.dev/run=bad"
                ).items
            ),
            what="the deleted run's pods are collected",
        )
    assert operator.error is None
    core.delete_namespace(namespace)


def test_a_lost_node_ends_the_incarnation_without_waiting_for_eviction(cluster, api):
    ns = RunNamespace(api, "nl")
    namespace, core, runs = ns.name, ns.core, ns.runs
    body = rolloutrun("nl")
    body["spec"]["recovery"]["nodeLossTimeoutSeconds"] = 1

    def status() -> dict[str, Any]:
        found = runs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "nl")
        return found.get("status") or {}

    def ready() -> bool:
        return any(
            c["type"] == "Ready" and c["status"] == "True" for c in status().get("conditions") or []
        )

    with operator_thread(cluster, namespace) as operator:
        runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
        eventually(ready, what="run ready")
        cluster.lose_node("freeze")
        try:
            eventually(lambda: status().get("incarnation") == 2, what="incarnation 2")
            assert status()["lastFailure"]["reason"] == "NodeLost"
            assert (status()["preemptions"], status()["restarts"]) == (1, 0)
        finally:
            cluster.restore_node()
        eventually(lambda: ready() and status()["incarnation"] == 2, what="running again")
        names = {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
        assert not [name for name in names if "-i1-" in name]
    assert operator.error is None
    core.delete_namespace(namespace)


class Namespace(RunNamespace):
    """One test namespace: the run's status and conditions, its pods, a wake-up poke."""

    def ready(self, name: str) -> tuple[str, str, str]:
        item = self.ready_condition(name)
        return item.get("status", ""), item.get("reason", ""), item.get("message", "")

    def poke(self, name: str) -> None:
        """Wake the run's daemon now (a deleted Secret or Role is not watched)."""
        patch = {"metadata": {"annotations": {"test/poke": uuid.uuid4().hex}}}
        self.runs.patch_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, name, patch)

    def pods(self, run: str) -> dict[str, Any]:
        items = self.core.list_namespaced_pod(
            self.name, label_selector=f"rolloutrun.dev/run={run}"
        ).items
        return {pod.metadata.name: pod for pod in items}

    def event_reasons(self) -> set[str]:
        return {event.reason for event in self.core.list_namespaced_event(self.name).items}


def test_objects_holding_a_childs_name_are_conflicts_never_adopted(cluster, api):
    ns = Namespace(api, "own")
    attacker = "attacker-known-token"
    ns.core.create_namespaced_secret(
        ns.name, {"metadata": {"name": "own-gym-token"}, "stringData": {"token": attacker}}
    )
    rules = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    ns.rbac.create_namespaced_role(ns.name, {"metadata": {"name": "own-member"}, "rules": rules})
    fence = {"holderIdentity": "own-i999-trainer/999", "leaseDurationSeconds": 3600}
    ns.leases.create_namespaced_lease(ns.name, {"metadata": {"name": "own-trainer"}, "spec": fence})
    # a pod of someone else's that carries the run's labels (no owner reference)
    squatter = {
        "metadata": {
            "name": "squatter",
            "labels": {"rolloutrun.dev/run": "own", "rolloutrun.dev/role": "gym"},
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "c", "image": "x", "command": ["rolloutrun", "squat"]}],
        },
    }
    ns.core.create_namespaced_pod(ns.name, squatter)
    # and one holding the trainer's name, without the run's label: met only by a 409 on create
    squatter["metadata"] = {"name": "own-i1-trainer"}
    ns.core.create_namespaced_pod(ns.name, squatter)
    with operator_thread(cluster, ns.name) as operator:
        ns.create_run(rolloutrun("own"))
        eventually(lambda: ns.ready("own")[1] == "ChildConflict", what="conflict reported")
        _status, _reason, message = ns.ready("own")
        for ref in ("Secret/own-gym-token", "Role/own-member", "Lease/own-trainer"):
            assert f"{ref} exists and is not owned by this run (owner: no owner)" in message
        assert set(ns.pods("own")) == {"squatter"}  # no member started beside them
        # the pass posts IncarnationStarting then ChildConflict: wait for the second
        eventually(lambda: "ChildConflict" in ns.event_reasons(), what="ChildConflict Event")
        # removed one by one: each still held name keeps the run waiting, named
        ns.core.delete_namespaced_secret("own-gym-token", ns.name)
        ns.poke("own")
        eventually(lambda: "Secret/" not in ns.ready("own")[2], what="secret conflict cleared")
        assert ns.ready("own")[1] == "ChildConflict" and "Lease/own-trainer" in ns.ready("own")[2]
        assert set(ns.pods("own")) == {"squatter"}
        ns.rbac.delete_namespaced_role("own-member", ns.name)
        ns.leases.delete_namespaced_lease("own-trainer", ns.name)
        ns.poke("own")
        eventually(lambda: "Pod/own-i1-trainer" in ns.ready("own")[2], what="pod name held")
        assert ns.ready("own")[1] == "ChildConflict" and "own-i1-trainer" not in ns.pods("own")
        ns.core.delete_namespaced_pod("own-i1-trainer", ns.name)
        ns.poke("own")
        eventually(lambda: ns.ready("own")[:2] == ("True", "Running"), what="run ready")
        token = ns.core.read_namespaced_secret("own-gym-token", ns.name)
        assert token.metadata.owner_references[0].uid == ns.run("own")["metadata"]["uid"]
        assert base64.b64decode(token.data["token"]).decode() != attacker
        lease = ns.leases.read_namespaced_lease("own-trainer", ns.name)
        assert lease.metadata.owner_references[0].name == "own"
        assert lease.spec.holder_identity is None
        # recovery (a lost trainer pod ends incarnation 1) leaves the squatter alone
        ns.core.delete_namespaced_pod("own-i1-trainer", ns.name)
        eventually(lambda: ns.run("own")["status"].get("incarnation") == 2, what="incarnation 2")
        eventually(lambda: ns.ready("own")[:2] == ("True", "Running"), what="running again")
        pods = ns.pods("own")
        assert set(pods) == {"squatter", "own-i2-trainer", "own-i2-gym-0", "own-i2-gym-1"}
        assert pods["squatter"].metadata.deletion_timestamp is None
        assert pods["squatter"].status.phase == "Running"
    assert operator.error is None
    ns.core.delete_namespace(ns.name)


def test_a_name_freed_between_the_409_and_the_read_back_is_not_claimed(cluster, api):
    """Under load the conflicts test above restarted its run on its own: the pod holding the
    trainer's name ended between the create's 409 and the read-back, the create counted as
    "existed", the pass claimed the trainer launched and the next found it lost. Here the
    holder ends at that point every time: the create must not report the child as there."""
    import asyncio

    from rolloutrun_operator.kube import Kube, NameFreed, load_credentials

    ns = Namespace(api, "freed")
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x", "command": ["rolloutrun", "x"]}]},
    }
    ns.core.create_namespaced_pod(ns.name, pod)

    def gone() -> bool:
        return "p" not in {p.metadata.name for p in ns.core.list_namespaced_pod(ns.name).items}

    class HolderEndsAfterTheConflict(Kube):
        async def create(self, manifest: dict[str, Any]) -> bool:
            created = await super().create(manifest)
            if not created:
                ns.core.delete_namespaced_pod("p", ns.name, grace_period_seconds=0)
                eventually(gone, what="p gone")
            return created

    manifest = {"apiVersion": "v1", "kind": "Pod", **pod}
    manifest["metadata"] = {"name": "p", "namespace": ns.name}

    async def create() -> bool:
        kube = HolderEndsAfterTheConflict(load_credentials(str(cluster.kubeconfig_path)))
        try:
            return await kube.create_owned(manifest)
        finally:
            await kube.close()

    with pytest.raises(NameFreed, match="Pod/p was taken on create and gone"):
        asyncio.run(create())
    assert gone()  # nothing was created: the next pass creates it
    ns.core.delete_namespace(ns.name)


def test_a_conflict_with_a_terminating_holder_says_so(cluster, api):
    """The conflicts test above waited 20 min under load: the squatter was still terminating
    when the run was poked, and its end wakes nothing. A held-up deletion (a finalizer)
    stands for a slow one."""
    import asyncio

    from rolloutrun_operator.kube import ChildConflict, Kube, load_credentials

    ns = Namespace(api, "term")
    pod = {
        "metadata": {"name": "p", "finalizers": ["test.rolloutrun.dev/hold"]},
        "spec": {"containers": [{"name": "c", "image": "x", "command": ["rolloutrun", "x"]}]},
    }
    ns.core.create_namespaced_pod(ns.name, pod)
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": pod["spec"]}
    manifest["metadata"]["namespace"] = ns.name

    async def conflict() -> ChildConflict:
        kube = Kube(load_credentials(str(cluster.kubeconfig_path)))
        try:
            with pytest.raises(ChildConflict) as raised:
                await kube.create_owned(manifest)
            return raised.value
        finally:
            await kube.close()

    assert asyncio.run(conflict()).terminating is False
    ns.core.delete_namespaced_pod("p", ns.name)
    assert ns.core.read_namespaced_pod("p", ns.name).metadata.deletion_timestamp is not None
    assert asyncio.run(conflict()).terminating is True
    ns.core.patch_namespaced_pod("p", ns.name, {"metadata": {"finalizers": None}})
    ns.core.delete_namespace(ns.name)


def test_a_delete_names_the_uid_it_observed_and_spares_a_replacement(cluster, api):
    import asyncio

    from rolloutrun_operator.kube import Kube, load_credentials

    ns = Namespace(api, "del")
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": "x", "command": ["rolloutrun", "x"]}]},
    }
    old = ns.core.create_namespaced_pod(ns.name, pod).metadata.uid
    ns.core.delete_namespaced_pod("p", ns.name, grace_period_seconds=0)
    eventually(
        lambda: "p" not in {p.metadata.name for p in ns.core.list_namespaced_pod(ns.name).items},
        what="p gone",
    )
    new = ns.core.create_namespaced_pod(ns.name, pod).metadata.uid

    async def delete(uid: str) -> bool:
        kube = Kube(load_credentials(str(cluster.kubeconfig_path)))
        try:
            return await kube.delete("Pod", ns.name, "p", 0, uid=uid)
        finally:
            await kube.close()

    assert asyncio.run(delete(old)) is False
    assert ns.core.read_namespaced_pod("p", ns.name).metadata.uid == new
    assert asyncio.run(delete(new)) is True
    ns.core.delete_namespace(ns.name)


def test_service_account_name_needs_the_accounts_consent(cluster, api):
    ns = Namespace(api, "sa")
    ns.core.create_namespaced_service_account(ns.name, {"metadata": {"name": "robot"}})
    body = rolloutrun("sa")
    body["spec"]["serviceAccountName"] = "robot"
    with operator_thread(cluster, ns.name) as operator:
        ns.create_run(body)
        eventually(lambda: ns.ready("sa")[1] == "ServiceAccountNotAllowed", what="refused")
        assert "rolloutrun.dev/allow-runs" in ns.ready("sa")[2] and "'robot'" in ns.ready("sa")[2]
        assert ns.pods("sa") == {}
        allow = {"metadata": {"annotations": {"rolloutrun.dev/allow-runs": "other, sa"}}}
        ns.core.patch_namespaced_service_account("robot", ns.name, allow)
        ns.poke("sa")
        eventually(lambda: ns.ready("sa")[:2] == ("True", "Running"), what="run ready")
        pods = ns.pods("sa")
        assert {pod.spec.service_account_name for pod in pods.values()} == {"robot"}
        binding = ns.rbac.read_namespaced_role_binding("sa-member", ns.name)
        assert [(s.kind, s.name) for s in binding.subjects] == [("ServiceAccount", "robot")]
        role = ns.rbac.read_namespaced_role(binding.role_ref.name, ns.name)
        (rule,) = role.rules
        assert rule.resources == ["leases"] and rule.resource_names == ["sa-trainer"]
        assert {"get", "update"} <= set(rule.verbs)
        # its own ServiceAccount is not created: the pods run as the consenting one
        assert not [
            a.metadata.name
            for a in ns.core.list_namespaced_service_account(ns.name).items
            if a.metadata.name == "sa-member"
        ]
    assert operator.error is None
    ns.core.delete_namespace(ns.name)


@pytest.mark.parametrize("skew", [-60.0, 60.0], ids=["trainer-60s", "trainer+60s"])
def test_a_trainer_clock_skew_is_no_loss_until_it_stops_renewing(cluster, api, skew):
    """The trainer stamps renewTime with a clock a minute off the operator's: while it renews
    (four lease durations) the run goes on; once it stops, the operator's own clock expires
    the Lease after leaseDurationSeconds of no change."""
    import datetime as dt
    import time

    ns = RunNamespace(api, "sk")
    namespace, core, runs = ns.name, ns.core, ns.runs

    def status() -> dict[str, Any]:
        found = runs.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "sk")
        return found.get("status") or {}

    def skewed() -> dt.datetime:
        return dt.datetime.now(dt.UTC) + dt.timedelta(seconds=skew)

    with operator_thread(cluster, namespace) as operator:
        runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rolloutrun("sk"))
        eventually(lambda: status().get("incarnationStartTime"), what="trainer started")
        identity = "sk-i1-trainer/1"
        trainer = KubernetesLease(
            "sk-trainer", namespace, identity, 1, api_client=api, duration_seconds=2, clock=skewed
        )
        trainer.acquire(timeout=30)
        for _ in range(16):  # 8 s: four lease durations, renewed every 0.5 s
            trainer.renew()
            time.sleep(0.5)
        seen = eventually(lambda: status().get("lease"), what="the renewal observed")
        assert seen["holder"] == "sk-i1-trainer/1"
        assert status()["incarnation"] == 1 and "lastFailure" not in status()
        eventually(lambda: status().get("incarnation") == 2, timeout=30, what="expiry")
        assert status()["lastFailure"]["reason"] == "LeaseExpired"
        assert status()["restarts"] == 1
    assert operator.error is None
    core.delete_namespace(namespace)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_operator_command_serves_metrics_and_liveness_and_stops_on_sigterm(cluster, api):
    import signal
    import subprocess
    import urllib.request

    ns = RunNamespace(api, "cli")
    namespace, core, runs = ns.name, ns.core, ns.runs
    metrics, health = free_port(), free_port()
    # cluster-wide, as the chart's default, as the chart's ServiceAccount and ClusterRole
    kubeconfig = operator_kubeconfig(cluster, permission_rules())
    command = [
        sys.executable, "-m", "rolloutrun_runtime.cli", "operator",
        "--kubeconfig", str(kubeconfig),
        "--metrics-port", str(metrics), "--liveness", f"http://127.0.0.1:{health}/healthz",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, rolloutrun("cli"))

        def scrape(port: int, path: str) -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                    return str(answer.read().decode())
            except OSError:
                return None

        def ready_metric() -> str | None:
            text = scrape(metrics, "/metrics") or ""
            return text if 'rolloutrun_runs{condition="Ready"} 1.0' in text else None

        text = eventually(ready_metric, what="the run counted as Ready in /metrics")
        assert "rolloutrun_reconcile_duration_seconds_count" in text
        assert eventually(lambda: scrape(health, "/healthz"), what="liveness answers")
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr.decode()[-2000:]
    core.delete_namespace(namespace)
