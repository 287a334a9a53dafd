"""A run on any cluster: created, its trainer pod deleted mid-run, resumed, Succeeded.

Marked ``cluster``: it uses the Kubernetes API only, so it runs on the local cluster in the
default suite and on a real cluster with ``make e2e KUBECONFIG=... IMAGE=...``
(``pytest tests/e2e -m cluster --kubeconfig ... --image ...``; docs/operations.md).
"""

from __future__ import annotations

import pytest

from tests.e2e.any_cluster import ClusterRun, Target
from tests.e2e.conftest import RUN_BOUND_S, TINY, tiny

# On the local cluster it repeats test_lifecycle's trainer deletion: `make chaos` runs it there,
# `make e2e` against a real cluster.
pytestmark = [pytest.mark.cluster, pytest.mark.chaos]


def _published(run: ClusterRun) -> dict | None:
    status = run.status()
    return status if status.get("latestManifestUri") and status.get("trainStep") else None


def test_a_run_resumes_after_its_trainer_pod_is_deleted_and_succeeds(any_cluster: Target):
    run = any_cluster.start(tiny())
    run.wait(lambda: _published(run), "a published snapshot", RUN_BOUND_S)
    trainer = run.wait(lambda: run.pod("-trainer"), "a running trainer pod", RUN_BOUND_S)
    run.delete_pod(trainer)
    succeeded = run.wait(
        lambda: (
            run.condition("Succeeded").get("status") == "True"
            or run.condition("Failed").get("status") == "True"
        ),
        "Succeeded or Failed",
        RUN_BOUND_S,
    )
    assert succeeded
    status = run.status()
    assert run.condition("Succeeded")["status"] == "True", status
    assert status["trainStep"] == TINY["spec"]["run"]["grpo"]["maxSteps"]
    assert status["incarnation"] >= 2 and status["preemptions"] >= 1, status
    assert status["lastFailure"]["pod"] == trainer
    assert status["anchorStep"] is not None and status["latestManifestUri"]
    # every condition says why, and every time the operator wrote is RFC 3339
    for condition in status["conditions"]:
        assert condition["reason"], condition
        assert condition["lastTransitionTime"].endswith("Z"), condition
