"""A run whose member pods are shaped by pod templates trains to the end with the real
trainer and Gyms: the template's label, toleration, GPU limit, extra volume, mount and
variable are on the pods, and nothing of the operator's contract was lost on the way.

The local cluster's scheduler ignores resources, so the trainer with its ``nvidia.com/gpu``
limit runs here (on the CPU); a real scheduler would wait for a node with a free GPU.
"""

from __future__ import annotations

import pytest

from rolloutrun_localcluster.testing import eventually
from tests.e2e.conftest import RUN_BOUND_S, TINY, finish, tiny

MAX_STEPS = TINY["spec"]["run"]["grpo"]["maxSteps"]
TOLERATE = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def shaped(container: str, **resources: dict[str, str]) -> dict:
    return {
        "metadata": {"labels": {"team": "rl"}},
        "spec": {
            "tolerations": [TOLERATE],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "containers": [
                {
                    "name": container,
                    "resources": resources,
                    "env": [{"name": "SCRATCH", "value": "/scratch"}],
                    "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                }
            ],
        },
    }


@pytest.mark.chaos  # minutes on two cores: `make chaos` (the default suite stays under 15 min)
def test_a_run_shaped_by_pod_templates_succeeds(start_run):
    document = tiny(
        trainer={"template": shaped("trainer", limits={"nvidia.com/gpu": "1"})},
        gym={"template": shaped("gym")},
    )
    run = start_run(document)
    eventually(
        lambda: run.lease_holder() == "tiny-i1-trainer/1",
        timeout=RUN_BOUND_S,
        what="the shaped trainer holding its lease",
    )
    pods = run.pods()
    for name in ("tiny-i1-trainer", "tiny-i1-gym-0", "tiny-i1-gym-1"):
        pod = pods[name]
        assert pod.metadata.labels["team"] == "rl"
        assert [t.key for t in pod.spec.tolerations or [] if t.key == "nvidia.com/gpu"]
        (container,) = pod.spec.containers
        assert "/scratch" in {mount.mount_path for mount in container.volume_mounts}
        assert container.security_context.read_only_root_filesystem is True
    trainer = pods["tiny-i1-trainer"].spec.containers[0]
    assert trainer.resources.limits == {"nvidia.com/gpu": "1"}
    summary = finish(run)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS
    assert summary["audit"].get("ok") is True, summary["audit"]
