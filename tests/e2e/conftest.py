"""End-to-end runs: the local cluster, the operator, and the real runtime in its pods.

Each test starts its own :class:`~rolloutrun_localcluster.embedded.EmbeddedRun` (a cluster
costs well under a second) with a tiny run, so a disruption in one test never leaks into
another. Waits are polls with generous bounds that only catch hangs; nothing is timed.
"""

from __future__ import annotations

import copy
import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster.embedded import EmbeddedRun, condition_of
from rolloutrun_localcluster.testing import eventually
from tests.e2e import any_cluster as ac
from tests.e2e import options as opt
from tests.e2e.any_cluster import EmbeddedCluster, Target

#: A run that trains in seconds on 2 cores: 24 steps, snapshots every second, a trainer
#: checkpoint every 4 steps (so snapshots replay trained groups), short grace and lease.
TINY: dict[str, Any] = {
    "apiVersion": "rolloutrun.dev/v1alpha1",
    "kind": "RolloutRun",
    "metadata": {"name": "tiny"},
    "spec": {
        "storage": {"uri": "file:///replaced/by/the/embedded/run"},
        "gym": {"replicas": 2, "terminationGracePeriodSeconds": 5},
        "trainer": {"terminationGracePeriodSeconds": 20},
        "recovery": {
            "maxRestarts": 3,
            "backoffSeconds": 0,
            "leaseDurationSeconds": 4,
            "nodeLossTimeoutSeconds": 2,
        },
        "run": {
            "seed": 3,
            "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 32},
            "task": {"name": "arithmetic", "datasetSize": 256, "maxOperand": 9, "maxNewTokens": 4},
            "grpo": {
                "groupSize": 4,
                "promptsPerStep": 4,
                "maxSteps": 24,
                "learningRate": 0.01,
                "maxStaleness": 1,
            },
            "checkpointing": {
                "savePeriod": 4,
                "snapshotIntervalSeconds": 1,
                "targetLevel": "sibling",
                "preemptionGraceSeconds": 10,
            },
            "workers": {"backend": "inprocess"},
        },
    },
}

#: Bound on a whole run (start, disruption, recovery, finish): only catches a hang.
RUN_BOUND_S = 240.0


def tiny(**spec: Any) -> dict[str, Any]:
    """TINY with ``spec`` sections merged one level deep."""
    document = copy.deepcopy(TINY)
    for key, value in spec.items():
        section = document["spec"].setdefault(key, {})
        section.update(value)
    return document


@pytest.fixture
def start_run(tmp_path: Path) -> Iterator[Callable[..., EmbeddedRun]]:
    started: list[EmbeddedRun] = []

    def start(document: dict[str, Any] | None = None, **options: Any) -> EmbeddedRun:
        run = EmbeddedRun(document or tiny(), tmp_path / f"run{len(started)}", **options)
        started.append(run)
        return run.start()

    yield start
    for run in started:
        run.stop()


def wait_for_snapshot(run: EmbeddedRun, at_least_step: int = 1) -> dict[str, Any]:
    """The status once the operator mirrors a published manifest past ``at_least_step``."""

    def published() -> dict[str, Any] | None:
        status = run.status()
        if status.get("latestManifestUri") and int(status.get("trainStep") or 0) >= at_least_step:
            return status
        return None

    return eventually(published, timeout=RUN_BOUND_S, interval=0.2, what="a published snapshot")


def finish(run: EmbeddedRun) -> dict[str, Any]:
    """Follow the run to its end and return the summary (with the audit)."""
    result, preempted = run.follow(timeout=RUN_BOUND_S, interval=0.2)
    return run.summary(result, preempted)


def run_starts(run: EmbeddedRun) -> list[dict[str, Any]]:
    """The trace's ``run_started`` events: one per trainer incarnation that got going."""
    trace = run.log_dir / "rollout_trace.jsonl"
    events = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    return [event for event in events if event.get("event") == "run_started"]


def assert_recovered_cleanly(
    run: EmbeddedRun, summary: dict[str, Any], *, from_snapshot: bool = True
) -> None:
    """Succeeded at maxSteps, a later incarnation resumed from durable state, audit clean.

    ``from_snapshot``: that state is a snapshot manifest, as after a loss whose trainer
    publishes its forced snapshot. A trainer killed with no notice (frozen, its node lost)
    publishes none, so the newest durable entry may as well be a trainer checkpoint newer
    than the last snapshot, and restore rightly takes it."""
    max_steps = TINY["spec"]["run"]["grpo"]["maxSteps"]
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == max_steps
    assert summary["incarnations"] >= 2
    assert summary["final_weights_sha256"]
    starts = run_starts(run)
    assert len(starts) >= 2
    assert starts[0]["snapshot_id"] is None
    assert any(start["resumed_from"] is not None for start in starts[1:]), starts
    if from_snapshot:
        assert any(start["snapshot_id"] is not None for start in starts[1:]), starts
    status = run.status()
    assert condition_of(status, "Succeeded")["status"] == "True"
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert summary["audit_holds"]


def kill_pod_processes(run: EmbeddedRun, pod: str, signum: signal.Signals) -> set[int]:
    import os

    pids = run.pod_pids(pod)
    assert pids, f"{pod} has no live process"
    for pid in pids:
        os.kill(pid, signum)
    return pids


@pytest.fixture
def any_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """The cluster a ``cluster`` test runs on: the one ``--kubeconfig`` names (``make e2e``,
    the operator and CRD installed there), else a local cluster with the operator in process."""
    from kubernetes import config

    option = request.config.getoption
    kubeconfig = option(opt.KUBECONFIG_OPTION)
    if not kubeconfig:
        with EmbeddedCluster(tmp_path) as (api, namespace):
            yield Target(api, namespace, local_storage=tmp_path / "storage")
        return
    api = config.new_client_from_config(config_file=kubeconfig)
    given = option(opt.NAMESPACE_OPTION)
    namespaces = iter([given]) if given else ac.fresh_namespace(api, option(opt.KEEP_OPTION))
    try:
        for namespace in namespaces:
            yield Target(
                api,
                namespace,
                image=option(opt.IMAGE_OPTION),
                storage_class=option(opt.STORAGE_CLASS_OPTION),
                storage_uri=option(opt.STORAGE_URI_OPTION),
            )
    finally:
        api.close()
