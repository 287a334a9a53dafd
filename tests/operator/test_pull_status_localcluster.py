"""A RolloutRun whose images cannot be pulled says so, end to end on the local cluster.

The local cluster's kubelet pulls as a real one (rolloutrun_localcluster/images.py): a Gym
image on a registry that cannot exist goes ``ErrImagePull`` then ``ImagePullBackOff``, a
trainer image the cluster refuses likewise; the operator turns the kubelet's waiting reason
into the run's ``Ready=False`` reason (``GymImagePullBackOff``, ``TrainerErrImagePull``) and
a Warning Event, and ``kubectl get rr`` prints it. (That a pull succeeds once the image
exists is the kubelet's test, tests/localcluster/test_image_pulls.py.) A crash loop, as the
kubelet reports it, reads as the run's reason too.
"""

from __future__ import annotations

import json
from typing import Any

from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import naming
from rolloutrun_operator.observe import pod_view
from rolloutrun_operator.problems import pod_problem
from tests.support.kubectl import kubectl, wait_for_ready_reason
from tests.support.operator_cluster import (
    GROUP,
    PLURAL,
    VERSION,
    RunNamespace,
    operator_thread,
    rolloutrun,
)


def test_an_image_that_cannot_be_pulled_is_the_runs_ready_reason(cluster: Any, api: Any) -> None:
    ns = RunNamespace(api, "pull")
    namespace, runs = ns.name, ns.runs

    gym_image = "registry.invalid/rolloutrun/gym:none"
    nogym = rolloutrun("nogym")
    nogym["spec"]["images"] = {"gym": gym_image}
    trainer_image = f"example.com/{namespace}/trainer:v1"
    cluster.images.refuse(trainer_image)
    notrainer = rolloutrun("notrainer")
    notrainer["spec"]["images"] = {"trainer": trainer_image}
    with operator_thread(cluster, namespace) as operator:
        for run in (nogym, notrainer):
            runs.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, run)
        # the kubelet alternates: ErrImagePull at each try, ImagePullBackOff in between
        backing_off = wait_for_ready_reason(
            cluster, namespace, "nogym", "GymImagePullBackOff", interval=0.2
        )
        message = backing_off["message"]
        assert message.startswith("pod nogym-i1-gym-")
        assert f'ImagePullBackOff: Back-off pulling image "{gym_image}": ErrImagePull: ' in message
        assert "lookup registry.invalid: no such host" in message
        table = kubectl(cluster, "get", "rr", "nogym", namespace=namespace).splitlines()
        column = table[0].index("REASON")  # cells start under their header (some are empty)
        assert table[1][column:].split()[0] in ("GymImagePullBackOff", "GymErrImagePull")

        pull_failures = ("TrainerErrImagePull", "TrainerImagePullBackOff")
        failed = wait_for_ready_reason(cluster, namespace, "notrainer", *pull_failures)
        assert "pull access denied" in failed["message"]
        assert ns.warning_reasons("notrainer") & set(pull_failures)
    assert operator.error is None


def test_a_crash_loop_as_the_kubelet_reports_it_is_a_pod_problem(cluster: Any, api: Any) -> None:
    """Members run with ``restartPolicy: Never`` (a crashed member is a lost member, replaced
    by the operator), so a crash loop is seen only on a pod that restarts in place: the
    kubelet's own status of one (the default back-off, 10 s) reads as
    ``TrainerCrashLoopBackOff`` with the kubelet's message."""
    ns = RunNamespace(api, "loop")
    labels = {naming.LABEL_ROLE: "trainer", naming.LABEL_INCARNATION: "1"}
    container = {"name": "trainer", "image": "busybox", "command": ["sh", "-c", "exit 1"]}
    body = {
        "metadata": {"name": "looping-i1-trainer", "labels": labels},
        "spec": {"restartPolicy": "Always", "containers": [container]},
    }
    ns.core.create_namespaced_pod(ns.name, body)

    def problem() -> Any:
        raw = ns.core.read_namespaced_pod("looping-i1-trainer", ns.name, _preload_content=False)
        found = pod_problem(pod_view(json.loads(raw.data)))
        return found if found and found[0] == "TrainerCrashLoopBackOff" else None

    _, message = eventually(problem, timeout=60, what="CrashLoopBackOff")
    uid = ns.core.read_namespaced_pod("looping-i1-trainer", ns.name).metadata.uid
    assert message == (
        "pod looping-i1-trainer container trainer: CrashLoopBackOff: back-off 10s restarting "
        f"failed container=trainer pod=looping-i1-trainer_{ns.name}({uid})"
    )
    ns.core.delete_namespaced_pod("looping-i1-trainer", ns.name, grace_period_seconds=0)
