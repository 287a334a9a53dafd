"""A queued RolloutRun's Kueue Workload follows its size, on the local cluster with the
operator under the chart's rules and stand-in members (Kueue emulated by
:mod:`tests.support.kueue_admitter`).

Kueue's rule: podSets are immutable while quota is reserved. So a size change of a run
waiting for admission updates its Workload in place (same uid, new podSets); a size change
of an admitted run stops its members and replaces the Workload (a new uid, queued with the
new podSets). A watch on the Workloads checks that no admitted Workload's podSets ever
changed.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from kubernetes import client as k8s
from kubernetes import watch

from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import kueue
from tests.support.kueue_admitter import CRDS, GROUP, VERSION, Admitter
from tests.support.operator_cluster import (
    GROUP as RR_GROUP,
)
from tests.support.operator_cluster import (
    PLURAL as RR_PLURAL,
)
from tests.support.operator_cluster import (
    VERSION as RR_VERSION,
)
from tests.support.operator_cluster import (
    RunNamespace,
    operator_thread,
    rolloutrun,
)

WORKLOAD = "rolloutrun-sized"


def _counts(body: dict[str, Any]) -> dict[str, int]:
    return {s["name"]: s["count"] for s in body["spec"]["podSets"]}


def test_the_workloads_pod_sets_follow_the_runs_size(cluster: Any, api: Any) -> None:
    extensions: Any = k8s.ApiextensionsV1Api(api)
    for crd in CRDS:
        with contextlib.suppress(k8s.ApiException):  # another test's cluster has them
            extensions.create_custom_resource_definition(crd)
    ns = RunNamespace(api, "kq")
    admitter = Admitter(api, ns.name)
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def record() -> None:  # every version of every Workload the namespace had
        stream = watch.Watch()
        objects: Any = k8s.CustomObjectsApi(api)
        for event in stream.stream(
            objects.list_namespaced_custom_object, GROUP, VERSION, ns.name, "workloads",
            timeout_seconds=120,
        ):  # fmt: skip
            seen.append(event["object"])
            if stop.is_set():
                stream.stop()

    recorder = threading.Thread(target=record, daemon=True)
    recorder.start()
    run = rolloutrun("sized")
    run["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-queue"}

    def resize(gym: dict[str, Any]) -> None:
        patch = {"spec": {"gym": gym}}
        ns.runs.patch_namespaced_custom_object(
            RR_GROUP, RR_VERSION, ns.name, RR_PLURAL, "sized", patch
        )

    with operator_thread(cluster, ns.name) as operator:
        ns.create_run(run)
        first = eventually(lambda: admitter.workload(WORKLOAD), what="the run's Workload")
        assert _counts(first) == {"trainer": 1, "gym": 2}

        # waiting for admission: updated in place
        resize({"replicas": 3})
        updated = eventually(
            lambda: (w := admitter.workload(WORKLOAD)) and _counts(w)["gym"] == 3 and w,
            what="the Workload updated to three Gyms",
        )
        assert updated["metadata"]["uid"] == first["metadata"]["uid"]

        # admitted and running: the members stop, the Workload is replaced
        admitter.flavor(f"local-{ns.name}", {"kubernetes.io/os": "linux"})
        admitter.admit(WORKLOAD, f"local-{ns.name}")
        eventually(
            lambda: len(ns.core.list_namespaced_pod(ns.name).items) == 4, what="four members"
        )
        resize({"replicas": 1, "resources": {"requests": {"cpu": "100m"}}})

        def replaced() -> dict[str, Any] | None:
            body = admitter.workload(WORKLOAD)
            fresh = body and body["metadata"]["uid"] != first["metadata"]["uid"]
            return body if fresh else None

        second = eventually(replaced, what="a new Workload")
        assert _counts(second) == {"trainer": 1, "gym": 1}
        (gym,) = [s for s in second["spec"]["podSets"] if s["name"] == "gym"]
        assert gym["template"]["spec"]["containers"][0]["resources"]["requests"] == {"cpu": "100m"}
        assert not (second.get("status") or {}).get("admission")
        assert ns.core.list_namespaced_pod(ns.name).items == []
        eventually(
            lambda: ns.ready_condition("sized").get("reason") == kueue.QUEUED,
            what="queued again",
        )
    stop.set()
    assert operator.error is None
    admitted = [w for w in seen if (w.get("status") or {}).get("admission")]
    assert admitted, "the watch saw the admission"
    assert {_counts(w)["gym"] for w in admitted} == {3}  # never changed under a reservation
