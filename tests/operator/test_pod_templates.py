"""Pod templates (``spec.trainer.template``, ``spec.gym.template``): what they add to the
member pods, and every field of the operator's they may not override, refused by name."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from rolloutrun_operator import builders, naming
from rolloutrun_operator.api.pod_template import PodTemplate
from rolloutrun_operator.api.validation import RolloutRunInvalid, parse_rolloutrun
from rolloutrun_operator.pod_templates import TemplateConflict, merge_template
from tests.support.rolloutruns import BASE, make_run

K8S_VERSION = "1.33.0"

GPU_TEMPLATE: dict[str, Any] = {
    "metadata": {"labels": {"team": "rl"}, "annotations": {"cost-center": "42"}},
    "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
        "priorityClassName": "training",
        "imagePullSecrets": [{"name": "registry"}],
        "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}],
        "securityContext": {"fsGroup": 2000, "supplementalGroups": [44]},
        "containers": [
            {
                "name": "trainer",
                "resources": {
                    "requests": {"cpu": "8", "memory": "64Gi"},
                    "limits": {"nvidia.com/gpu": "8"},
                },
                "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                "securityContext": {"runAsUser": 1000},
            }
        ],
    },
}


def trainer_with(template: dict[str, Any], **spec: Any) -> Any:
    run = make_run(trainer={"template": template}, **spec)
    return builders.trainer_pod(run, 3)


def test_a_gpu_request_and_a_toleration_are_rendered_into_the_trainer_pod():
    pod = trainer_with(GPU_TEMPLATE)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert container["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert spec["affinity"] == GPU_TEMPLATE["spec"]["affinity"]
    assert spec["priorityClassName"] == "training"
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in container["env"]
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["annotations"] == {"cost-center": "42"}
    assert spec["securityContext"]["fsGroup"] == 2000
    assert spec["securityContext"]["supplementalGroups"] == [44]
    assert container["securityContext"]["runAsUser"] == 1000


def test_the_operators_fields_survive_the_template():
    plain, shaped = builders.trainer_pod(make_run(), 3), trainer_with(GPU_TEMPLATE)
    for key in ("name", "namespace", "ownerReferences"):
        assert shaped["metadata"][key] == plain["metadata"][key]
    assert shaped["metadata"]["labels"] == {**plain["metadata"]["labels"], "team": "rl"}
    for key in ("serviceAccountName", "automountServiceAccountToken", "restartPolicy"):
        assert shaped["spec"][key] == plain["spec"][key]
    assert shaped["spec"]["securityContext"]["runAsNonRoot"] is True
    (before,), (after,) = plain["spec"]["containers"], shaped["spec"]["containers"]
    for key in ("name", "command", "ports", "image", "workingDir"):
        assert after[key] == before[key]
    assert after["env"][: len(before["env"])] == before["env"]  # the contract first, intact
    assert after["volumeMounts"][: len(before["volumeMounts"])] == before["volumeMounts"]
    security = after["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}


def test_the_merge_is_pure():
    pod = builders.trainer_pod(make_run(), 3)
    before = copy.deepcopy(pod)
    merge_template(pod, PodTemplate.model_validate(GPU_TEMPLATE), "spec.trainer.template")
    assert pod == before


def test_a_gym_template_shapes_every_gym_and_not_the_trainer():
    template = {
        "spec": {
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "containers": [{"name": "gym", "resources": {"limits": {"cpu": "2"}}}],
        }
    }
    run = make_run(gym={"template": template})
    for index in range(2):
        pod = builders.gym_pod(run, 1, index)
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        assert pod["spec"]["tolerations"] == [{"key": "spot", "operator": "Exists"}]
        assert pod["spec"]["containers"][0]["resources"]["limits"] == {"cpu": "2"}
        assert pod["spec"]["automountServiceAccountToken"] is False
    assert "tolerations" not in builders.trainer_pod(run, 1)["spec"]


def refused(document: dict[str, Any]) -> list[str]:
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(document)
    return caught.value.problems


def document(trainer_template: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(BASE)
    doc["spec"]["trainer"] = {"template": trainer_template}
    return doc


@pytest.mark.parametrize(
    ("template", "field", "why"),
    [
        (
            {"spec": {"containers": [{"name": "trainer", "command": ["sh"]}]}},
            "spec.trainer.template.spec.containers.0.command",
            "entry point",
        ),
        (
            {"spec": {"containers": [{"name": "trainer", "ports": [{"containerPort": 1}]}]}},
            "spec.trainer.template.spec.containers.0.ports",
            "ports",
        ),
        (
            {"spec": {"containers": [{"name": "trainer", "image": "evil"}]}},
            "spec.trainer.template.spec.containers.0.image",
            "spec.images",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {"name": "trainer", "securityContext": {"readOnlyRootFilesystem": False}}
                    ]
                }
            },
            "spec.trainer.template.spec.containers.0.securityContext.readOnlyRootFilesystem",
            "read-only root filesystem",
        ),
        (
            {
                "spec": {
                    "containers": [{"name": "trainer", "securityContext": {"privileged": True}}]
                }
            },
            "spec.trainer.template.spec.containers.0.securityContext.privileged",
            "never privileged",
        ),
        (
            {"spec": {"automountServiceAccountToken": False}},
            "spec.trainer.template.spec.automountServiceAccountToken",
            "token",
        ),
        (
            {"spec": {"serviceAccountName": "robot"}},
            "spec.trainer.template.spec.serviceAccountName",
            "spec.serviceAccountName",
        ),
        (
            {"spec": {"securityContext": {"runAsNonRoot": False}}},
            "spec.trainer.template.spec.securityContext.runAsNonRoot",
            "non-root",
        ),
        (
            {"metadata": {"ownerReferences": [{"name": "x"}]}},
            "spec.trainer.template.metadata.ownerReferences",
            "owns its pods",
        ),
        (
            {"metadata": {"name": "mine"}},
            "spec.trainer.template.metadata.name",
            "names member pods",
        ),
    ],
)
def test_a_protected_field_in_a_template_is_refused_by_name(template, field, why):
    doc = document(template)
    (problem,) = refused(doc)
    assert problem.startswith(f"{field}: protected: ") and why in problem


@pytest.mark.parametrize(
    ("template", "field", "why"),
    [
        (
            {"metadata": {"labels": {naming.LABEL_ROLE: "gym"}}},
            "spec.trainer.template.metadata.labels['rolloutrun.dev/role']",
            "protected",
        ),
        (
            {"metadata": {"labels": {naming.LABEL_MANAGED_BY: "me"}}},
            "spec.trainer.template.metadata.labels['app.kubernetes.io/managed-by']",
            "protected",
        ),
        (
            {"metadata": {"annotations": {"rolloutrun.dev/anything": "x"}}},
            "spec.trainer.template.metadata.annotations['rolloutrun.dev/anything']",
            "protected",
        ),
        (
            {"metadata": {"labels": {"team": "not a value!"}}},
            "spec.trainer.template.metadata.labels['team']",
            "alphanumeric",
        ),
        (
            {
                "spec": {
                    "containers": [{"name": "trainer", "env": [{"name": "POD_NAME", "value": "x"}]}]
                }
            },
            "spec.trainer.template.spec.containers.0.env.0.name",
            "reserved",
        ),
        (
            {"spec": {"volumes": [{"name": "config", "emptyDir": {}}]}},
            "spec.trainer.template.spec.volumes.0.name",
            "protected",
        ),
        (
            {
                "spec": {
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "containers": [
                        {
                            "name": "trainer",
                            "volumeMounts": [
                                {"name": "x", "mountPath": "/etc/rolloutrun/run.yaml"}
                            ],
                        }
                    ],
                }
            },
            "spec.trainer.template.spec.containers.0.volumeMounts.0.mountPath",
            "'/etc/rolloutrun' (volume 'config'): protected",
        ),
        (
            {
                "spec": {
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "containers": [
                        {
                            "name": "trainer",
                            "volumeMounts": [{"name": "x", "mountPath": "/data/demo"}],
                        }
                    ],
                }
            },
            "spec.trainer.template.spec.containers.0.volumeMounts.0.mountPath",
            "(volume 'storage'): protected",
        ),
        (
            {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "volumeMounts": [{"name": "storage", "mountPath": "/x"}],
                        }
                    ]
                }
            },
            "spec.trainer.template.spec.containers.0.volumeMounts.0.name",
            "operator's own volumes",
        ),
        (
            {"spec": {"containers": [{"name": "sidecar"}]}},
            "spec.trainer.template.spec.containers.0.name",
            "the member container is 'trainer'",
        ),
    ],
)
def test_a_template_colliding_with_the_operators_pod_is_refused_by_name(template, field, why):
    (problem,) = refused(document(template))
    assert problem.startswith(f"{field}: ") and why in problem


def test_a_key_set_both_in_the_settings_and_the_template_is_refused():
    doc = copy.deepcopy(BASE)
    doc["spec"]["trainer"] = {
        "resources": {"limits": {"nvidia.com/gpu": "1"}},
        "nodeSelector": {"pool": "a"},
        "env": [{"name": "K", "value": "1"}],
        "template": {
            "spec": {
                "nodeSelector": {"pool": "b"},
                "containers": [
                    {
                        "name": "trainer",
                        "resources": {"limits": {"nvidia.com/gpu": "8"}},
                        "env": [{"name": "K", "value": "2"}],
                    }
                ],
            }
        },
    }
    problems = refused(doc)
    prefix = "spec.trainer.template.spec"
    assert problems == [
        f"{prefix}.nodeSelector['pool']: also set by spec.trainer.nodeSelector; set it in one "
        "place",
        f"{prefix}.containers.0.resources.limits['nvidia.com/gpu']: also set by "
        "spec.trainer.resources; set it in one place",
        f"{prefix}.containers.0.env.0.name: 'K' is also set by spec.trainer.env; set it in "
        "one place",
    ]


def test_the_gym_template_is_checked_against_the_gym_pod():
    doc = copy.deepcopy(BASE)
    doc["spec"]["gym"]["template"] = {"spec": {"containers": [{"name": "trainer"}]}}
    (problem,) = refused(doc)
    assert problem.startswith("spec.gym.template.spec.containers.0.name: ")
    assert "the member container is 'gym'" in problem


def test_the_workers_template_is_checked_against_the_worker_pod():
    doc = copy.deepcopy(BASE)
    doc["spec"]["run"] = {**doc["spec"].get("run", {}), "workers": {"backend": "ray"}}
    doc["spec"]["workers"] = {
        "replicas": 1,
        "template": {"spec": {"volumes": [{"name": "shm", "emptyDir": {}}]}},
    }
    (problem,) = refused(doc)
    assert problem.startswith("spec.workers.template.spec.volumes.0.name: ")


def test_a_template_conflict_in_the_builder_names_every_field():
    run = make_run()
    pod = builders.trainer_pod(run, 1)
    template = PodTemplate.model_validate(
        {"spec": {"volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "work", "emptyDir": {}}]}}
    )
    with pytest.raises(TemplateConflict) as caught:
        merge_template(pod, template, "spec.trainer.template")
    assert [line.split(":")[0] for line in caught.value.problems] == [
        "spec.trainer.template.spec.volumes.0.name",
        "spec.trainer.template.spec.volumes.1.name",
    ]


def test_template_secrets_are_waited_for():
    template = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "env": [
                        {"name": "HF", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}
                    ],
                }
            ]
        }
    }
    assert builders.referenced_secrets(make_run(trainer={"template": template})) == ["hf"]
