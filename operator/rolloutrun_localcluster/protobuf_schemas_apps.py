"""The protobuf messages of apps/v1's Deployment, in the table form of :mod:`.protobuf_schemas`.

Why: ``kubectl create deployment`` sends its Deployment as protobuf, like every built-in kind
kubectl creates imperatively; without these the cluster answered 415. Transcribed from
k8s.io/api ``apps/v1/generated.proto``; its pod template is core v1's ``PodTemplateSpec``,
whose ``PodSpec`` the core table holds. Deployments are stored, not run (no controller).
"""

from __future__ import annotations

APPS_ROOTS: dict[tuple[str, str], str] = {("apps/v1", "Deployment"): "Deployment"}

#: Pointer fields (see ``KEEP_ZERO``): ``replicas: 0`` asks for no pod, not the default one.
APPS_KEEP_ZERO: frozenset[str] = frozenset(
    {"replicas", "revisionHistoryLimit", "progressDeadlineSeconds", "collisionCount"}
)

APPS_MESSAGES: dict[str, str] = {
    "Deployment": "1 metadata ObjectMeta, 2 spec DeploymentSpec, 3 status DeploymentStatus",
    "DeploymentSpec": (
        "1 replicas i, 2 selector LabelSelector, 3 template PodTemplateSpec, "
        "4 strategy DeploymentStrategy, 5 minReadySeconds i, 6 revisionHistoryLimit i, "
        "7 paused b, 9 progressDeadlineSeconds i"
    ),
    "PodTemplateSpec": "1 metadata ObjectMeta, 2 spec PodSpec",
    "DeploymentStrategy": "1 type s, 2 rollingUpdate RollingUpdateDeployment",
    "RollingUpdateDeployment": "1 maxUnavailable IntOrString, 2 maxSurge IntOrString",
    "DeploymentStatus": (
        "1 observedGeneration i, 2 replicas i, 3 updatedReplicas i, 4 availableReplicas i, "
        "5 unavailableReplicas i, 6 conditions [DeploymentCondition], 7 readyReplicas i, "
        "8 collisionCount i, 9 terminatingReplicas i"
    ),
    "DeploymentCondition": (
        "1 type s, 2 status s, 4 reason s, 5 message s, 6 lastUpdateTime Time, "
        "7 lastTransitionTime Time"
    ),
}
