"""A RolloutRun's whole life on the local cluster with the real trainer and Gym pods.

Create → pods run → Succeeded; then, one disruption per test, the ways a member is lost
(trainer pod deleted, Gym pod deleted, trainer frozen until its lease expires, SIGTERM
preemption, node loss): each time the next incarnation resumes from the latest snapshot
manifest and the run still ends Succeeded at maxSteps with the audit clean (no prompt lost
or trained twice, no side effect applied twice).
"""

from __future__ import annotations

import base64
import http.client
import json
import signal
from typing import Any

from rolloutrun_localcluster.testing import eventually
from rolloutrun_runtime.cli import main as rolloutrun
from rolloutrun_runtime.contract.pod import TRAINER_METRICS_PORT
from rolloutrun_runtime.run_logs import read_stored_metrics
from rolloutrun_runtime.storage import open_storage
from tests.e2e.conftest import (
    RUN_BOUND_S,
    TINY,
    assert_recovered_cleanly,
    finish,
    kill_pod_processes,
    run_starts,
    tiny,
    wait_for_snapshot,
)
from tests.support.kubectl import kubectl

MAX_STEPS = TINY["spec"]["run"]["grpo"]["maxSteps"]


def test_a_run_is_created_runs_in_pods_and_succeeds_with_a_clean_audit(start_run):
    run = start_run()
    # While it trains, the trainer holds its Lease as <pod>/<incarnation>.
    eventually(
        lambda: run.lease_holder() == "tiny-i1-trainer/1",
        timeout=RUN_BOUND_S,
        what="the trainer holding its lease",
    )
    pods = run.pods()
    assert {"tiny-i1-trainer", "tiny-i1-gym-0", "tiny-i1-gym-1"} <= set(pods)
    assert pods["tiny-i1-trainer"].status.pod_ip != "127.0.0.1"  # pods have their own IPs
    _metrics_open_to_the_metrics_token_only(run, pods["tiny-i1-trainer"].status.pod_ip)

    summary = finish(run)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS
    assert summary["incarnations"] == 1
    assert summary["restarts"] == 0 and summary["preemptions"] == 0
    assert summary["final_weights_sha256"]
    # The trainer recorded its progress on the Lease; the operator mirrors it into status.
    lease = run.lease()
    assert lease.spec.holder_identity is None  # released on a clean exit
    annotations = lease.metadata.annotations
    assert annotations["rolloutrun.dev/train-step"] == str(MAX_STEPS)
    assert annotations["rolloutrun.dev/anchor-step"] == str(MAX_STEPS)
    assert annotations["rolloutrun.dev/latest-manifest"].endswith("MANIFEST.json")
    final = run.status()
    assert int(final["trainStep"]) == MAX_STEPS
    assert int(final["anchorStep"]) == MAX_STEPS
    assert final["latestManifestUri"] == annotations["rolloutrun.dev/latest-manifest"]
    assert final["latestManifestUri"].startswith(f"file://{run.storage_dir}/")
    steps = [json.loads(line)["step"] for line in (run.log_dir / "metrics.jsonl").open()]
    assert steps == list(range(1, MAX_STEPS + 1))
    # The last step's mean reward rides on the Lease into status (kubectl get rr: Reward).
    reward = json.loads((run.log_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert annotations["rolloutrun.dev/reward"] == f"{reward['reward_mean']:.6g}"
    assert final["lastReward"] == float(f"{reward['reward_mean']:.6g}")
    # The trainer pod stays (for its logs) and succeeded; the Gym pods are removed.
    eventually(lambda: set(run.pods()) == {"tiny-i1-trainer"}, what="the Gym pods removed")
    assert run.pods()["tiny-i1-trainer"].status.phase == "Succeeded"
    assert summary["audit"]["side_effects"]["applied"] > 0  # the Gym pods' audit files
    assert summary["audit"].get("ok") is True, summary["audit"]
    _what_users_watch_outlives_the_pods(run)


def _scrape(run: Any, pod_ip: str, token: str | None) -> int:
    """GET the trainer's ``/metrics`` as Prometheus would: 200 with metrics, else the HTTP
    status, 0 while nothing answers. In the cluster's namespace network mode pod IPs live
    in the cluster's node namespace: the socket is made there (``network.dialer``)."""
    network = run.cluster.network if run.cluster is not None else None
    dial = network.dialer() if network is not None else None
    connection = http.client.HTTPConnection(pod_ip, TRAINER_METRICS_PORT, timeout=10)
    try:
        if dial is not None:
            sock = dial()
            sock.settimeout(10)
            sock.connect((pod_ip, TRAINER_METRICS_PORT))
            connection.sock = sock
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        connection.request("GET", "/metrics", headers=headers)
        answer = connection.getresponse()
        body = answer.read().decode()
    except OSError:
        return 0  # not serving yet
    finally:
        connection.close()
    if answer.status != 200:
        return answer.status
    return 200 if "rolloutrun_trainer_step" in body else -1


def _metrics_open_to_the_metrics_token_only(run: Any, pod_ip: str) -> None:
    """The trainer pod's ``/metrics``, as a PodMonitor scrapes it: the key ``token`` of the
    run's metrics Secret opens it; no token and the run's data-plane token get 401."""

    def secret(name: str) -> str:
        data = run.core.read_namespaced_secret(name, run.namespace).data["token"]
        return base64.b64decode(data).decode()

    metrics_token = secret("tiny-metrics-token")
    eventually(lambda: _scrape(run, pod_ip, metrics_token) == 200, what="the trainer's /metrics")
    assert _scrape(run, pod_ip, None) == 401
    assert _scrape(run, pod_ip, secret("tiny-gym-token")) == 401


def _what_users_watch_outlives_the_pods(run: Any) -> None:
    """``kubectl logs`` shows one line a step; metrics are in the storage; ``rolloutrun
    audit --run`` reads the run from the cluster and its storage alone."""
    log = run.core.read_namespaced_pod_log("tiny-i1-trainer", run.namespace)
    lines = [line.split("rolloutrun_runtime.trainer: ")[-1] for line in log.splitlines()]
    assert [line.split()[0] for line in lines if line.startswith("step=")] == [
        f"step={step}/{MAX_STEPS}" for step in range(1, MAX_STEPS + 1)
    ]
    stored = read_stored_metrics(open_storage(f"file://{run.storage_dir}"))
    assert [row["step"] for row in stored] == list(range(1, MAX_STEPS + 1))
    kubeconfig = str(run.cluster.kubeconfig_path)
    where = ["--run", run.name, "-n", run.namespace, "--kubeconfig", kubeconfig]
    assert rolloutrun(["audit", *where]) == 0


def test_a_deleted_trainer_pod_is_replaced_and_the_run_resumes(start_run):
    run = start_run()
    wait_for_snapshot(run)
    run.delete_pod("tiny-i1-trainer")
    summary = finish(run)
    assert_recovered_cleanly(run, summary)
    last = run.status()["lastFailure"]
    assert last["reason"] == "PodDeleted" and last["pod"] == "tiny-i1-trainer"
    assert summary["preemptions"] >= 1 and summary["restarts"] == 0


def test_a_deleted_gym_pod_ends_the_incarnation_and_the_run_resumes(start_run):
    run = start_run(tiny(recovery={"elasticMembers": False}))  # elastic: test_elastic
    wait_for_snapshot(run)
    run.delete_pod("tiny-i1-gym-1")
    summary = finish(run)
    assert_recovered_cleanly(run, summary)
    last = run.status()["lastFailure"]
    assert last["reason"] == "PodDeleted" and last["pod"] == "tiny-i1-gym-1"


def test_a_frozen_trainer_loses_its_lease_and_is_replaced(start_run):
    run = start_run()
    wait_for_snapshot(run)
    kill_pod_processes(run, "tiny-i1-trainer", signal.SIGSTOP)  # hung: no renewals
    eventually(
        lambda: run.status().get("incarnation") == 2, timeout=120, what="incarnation 2 started"
    )
    last = run.status()["lastFailure"]
    assert last["reason"] == "LeaseExpired" and last["pod"] == "tiny-i1-trainer"
    summary = finish(run)
    assert_recovered_cleanly(run, summary, from_snapshot=False)  # hung: no forced snapshot
    assert summary["restarts"] == 1  # a hung trainer is a failure, not a preemption


def test_sigterm_publishes_a_forced_snapshot_that_the_next_incarnation_resumes(start_run):
    run = start_run()
    wait_for_snapshot(run)
    kill_pod_processes(run, "tiny-i1-trainer", signal.SIGTERM)  # a preemption notice
    eventually(
        lambda: run.status().get("incarnation") == 2, timeout=120, what="incarnation 2 started"
    )
    summary = finish(run)
    assert_recovered_cleanly(run, summary)
    snapshots = [
        json.loads(line) for line in (run.log_dir / "snapshots.jsonl").read_text().splitlines()
    ]
    forced = [s for s in snapshots if s.get("reason") == "preemption"]
    # One, or two when the step the notice found begun committed after the first's cut.
    outcomes = [s["rollout/checkpoint_outcome"] for s in forced]
    assert outcomes in (["published"], ["published"] * 2), snapshots
    second = run_starts(run)[1]
    assert second["snapshot_id"] is not None


def test_node_loss_moves_the_run_to_another_node(start_run):
    run = start_run(tiny(recovery={"nodeLossTimeoutSeconds": 2}), nodes=2)
    wait_for_snapshot(run)
    assert run.cluster is not None
    node = run.cluster.node_of("default", "tiny-i1-trainer")
    assert node is not None
    run.cluster.lose_node("kill", node=node)
    eventually(
        lambda: run.status().get("incarnation") == 2, timeout=120, what="incarnation 2 started"
    )
    assert run.status()["lastFailure"]["reason"] == "NodeLost"
    summary = finish(run)
    assert_recovered_cleanly(run, summary, from_snapshot=False)  # killed: no forced snapshot
    assert run.cluster.node_of("default", "tiny-i2-trainer") != node


def test_a_deleted_node_s_run_is_collected_by_podgc_and_moves(start_run):
    """``kubectl delete node`` (a cloud removing a preempted VM): the pods bound there read
    ``Running`` until PodGC collects them (``DeletionByPodGC``, then gone): a preemption, not a
    failure, and the next incarnation runs on the node that is left."""
    options = {"pod_gc": (0.2, 1.0)}  # the real 20 s period and 40 s quarantine, shortened
    document = tiny()
    document["spec"]["run"]["grpo"]["maxSteps"] = 400  # still training when PodGC comes
    run = start_run(document, nodes=2, cluster_options=options)
    wait_for_snapshot(run)
    assert run.cluster is not None
    node = run.cluster.node_of("default", "tiny-i1-trainer")
    assert node is not None
    kubectl(run.cluster, "delete", "node", node)
    eventually(
        lambda: run.status().get("incarnation") == 2, timeout=120, what="incarnation 2 started"
    )
    status = run.status()
    # PodGC writes its reason, then deletes: the operator may see either (as on a real cluster)
    assert status["lastFailure"]["reason"] in ("DeletionByPodGC", "PodDeleted"), status
    assert (status["preemptions"], status["restarts"]) == (1, 0)
    eventually(
        lambda: run.cluster.node_of("default", "tiny-i2-trainer"), what="trainer 2 scheduled"
    )
    assert run.cluster.node_of("default", "tiny-i2-trainer") != node
    resumed_at = int(status.get("trainStep") or 0)
    wait_for_snapshot(run, at_least_step=resumed_at + 1)  # incarnation 2 trains on


def _logged_at(log: str, marker: str) -> str:
    """The timestamp (``YYYY-MM-DD HH:MM:SS,mmm``, sortable) of the first line with ``marker``."""
    line = next((line for line in log.splitlines() if marker in line), None)
    assert line is not None, f"no {marker!r} in:\n{log[-2000:]}"
    return line[:23]


def test_a_deleted_gym_pod_stops_the_trainer_before_the_other_gym(start_run):
    """Issue 10, finding 2: the trainer's forced snapshot runs while the Gym still alive is
    up; that Gym is stopped only after the trainer."""
    document = tiny(recovery={"elasticMembers": False})  # elastic: the Gym is replaced
    document["spec"]["run"]["grpo"]["maxSteps"] = 400  # still training when the pod goes
    run = start_run(document)
    wait_for_snapshot(run)
    assert run.cluster is not None
    trainer_dir = run.cluster.pod_dir("default", "tiny-i1-trainer")
    survivor_dir = run.cluster.pod_dir("default", "tiny-i1-gym-0")
    assert trainer_dir is not None and survivor_dir is not None
    run.delete_pod("tiny-i1-gym-1")
    eventually(
        lambda: run.status().get("incarnation") == 2, timeout=120, what="incarnation 2 started"
    )
    status = run.status()
    assert status["lastFailure"]["pod"] == "tiny-i1-gym-1"
    assert (status["preemptions"], status["restarts"]) == (1, 0)
    notice = _logged_at((trainer_dir / "logs" / "trainer.log").read_text(), "preemption notice")
    stopped = _logged_at((survivor_dir / "logs" / "gym.log").read_text(), "stopping")
    assert notice <= stopped, (notice, stopped)
