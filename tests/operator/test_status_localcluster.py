"""What ``kubectl get rr`` shows on the local cluster: pods held back, reward, step rate.

The local cluster's kubelet runs commands, so a Gym whose ``PATH`` hides its command fails
to start as a real container runtime reports it (``StartError``, exit 128, ``exec: ...
executable file not found in $PATH``), a container whose ConfigMap is missing waits in
``CreateContainerConfigError``; its scheduler leaves a trainer with a node selector
no node matches ``PodScheduled=False`` (Unschedulable, with the scheduler's message). The
trainer is the stand-in ``rolloutrun`` (see test_handlers_localcluster.py); its reward and
steps are written by the runtime's own :class:`KubernetesLease`, as the trainer does.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import watching
from rolloutrun_runtime.coordination import KubernetesLease
from tests.support.kubectl import kubectl, wait_for_ready_reason
from tests.support.operator_cluster import (
    GROUP,
    PLURAL,
    VERSION,
    RunNamespace,
    operator_thread,
    rolloutrun,
)


# About a minute on two cores: `make chaos` (test_pull_status_localcluster.py keeps a pod
# problem as the Ready reason in the default suite; progress.py and problems.py are unit-tested).
@pytest.mark.chaos
def test_pods_held_back_are_ready_reasons_and_progress_shows_reward(cluster, api, monkeypatch):
    # progress every second instead of every two minutes (the throttle is watching.py's)
    monkeypatch.setattr(watching, "PROGRESS_MIRROR_SECONDS", 1.0)
    ns = RunNamespace(api, "st")
    namespace, runs = ns.name, ns.runs

    nostart = rolloutrun("nostart")
    nostart["spec"]["gym"]["env"] = [{"name": "PATH", "value": "/nonexistent"}]
    nostart["spec"]["recovery"]["backoffSeconds"] = 3600  # stays Restarting, says why
    noconfig = rolloutrun("noconfig")
    missing = {"configMapKeyRef": {"name": "no-such-config", "key": "k"}}
    noconfig["spec"]["gym"]["env"] = [{"name": "SETTING", "valueFrom": missing}]
    unplaced = rolloutrun("unplaced")
    unplaced["spec"]["trainer"]["nodeSelector"] = {"example.com/pool": "none"}
    with operator_thread(cluster, namespace) as operator:
        for run in (nostart, noconfig, unplaced, rolloutrun("healthy")):
            runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, run)

        message = wait_for_ready_reason(cluster, namespace, "nostart", "GymStartError")["message"]
        assert "exit code 128 (StartError)" in message
        assert 'exec: "rolloutrun": executable file not found in $PATH' in message
        assert "GymStartError" in ns.warning_reasons("nostart")

        reason = "GymCreateContainerConfigError"
        assert wait_for_ready_reason(cluster, namespace, "noconfig", reason)["message"] == (
            "pod noconfig-i1-gym-0 container gym: CreateContainerConfigError: "
            'configmap "no-such-config" not found'
        )
        assert "GymCreateContainerConfigError" in ns.warning_reasons("noconfig")

        reason = "TrainerUnschedulable"
        assert wait_for_ready_reason(cluster, namespace, "unplaced", reason)["message"] == (
            "pod unplaced-i1-trainer unschedulable: 0/1 nodes are available: "
            "1 node(s) didn't match Pod's node affinity/selector."
        )
        assert "TrainerUnschedulable" in ns.warning_reasons("unplaced")

        wait_for_ready_reason(cluster, namespace, "healthy", "Running")
        trainer = KubernetesLease(
            "healthy-trainer", namespace, "healthy-i1-trainer/1", 1, api_client=api
        )
        trainer.acquire(timeout=30)
        trainer.start_renewing()

        def status() -> dict[str, Any]:
            found = kubectl(cluster, "get", "rr", "healthy", "-o", "json", namespace=namespace)
            return json.loads(found)["status"]

        stepping = threading.Event()

        def train() -> None:  # a step a second, as the trainer reports them
            step = 0
            while not stepping.wait(1.0):
                step += 1
                trainer.record_progress(train_step=step, reward=0.4375)

        worker = threading.Thread(target=train, daemon=True)
        worker.start()
        try:
            eventually(
                lambda: status().get("lastReward") == 0.4375, interval=0.5, what="reward mirrored"
            )
            # the window closes after 60 s of the operator's clock
            eventually(lambda: status().get("stepRate"), timeout=180, interval=1.0, what="rate")
            stepping.set()
            worker.join()
            trainer.record_progress(train_step=1000, reward=0.5)
            eventually(lambda: status().get("trainStep") == 1000, interval=0.5, what="last step")
            wide = kubectl(cluster, "get", "rr", "healthy", "-o", "wide", namespace=namespace)
            table = wide.splitlines()
            header = table[0].split()
            assert header[:3] == ["NAME", "STEP", "REWARD"] and "STEPS/MIN" in header
            assert table[1].split()[:3] == ["healthy", "1000", "0.5"]
        finally:
            stepping.set()
            trainer.stop()
    assert operator.error is None
