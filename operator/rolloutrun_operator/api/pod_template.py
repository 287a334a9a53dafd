"""``spec.trainer.template`` and ``spec.gym.template``: the part of a PodTemplateSpec a user shapes.

Why a subset, not a whole PodTemplateSpec: the operator's own fields of a member pod (the
labels it selects on, the command, the ports, the Lease and env contract, the storage mount,
the read-only root filesystem, whether the token is mounted, the owner reference) carry
fencing and identity. A user shapes what a platform needs (scheduling, GPUs, pull secrets,
extra volumes, labels for cost tracking) and the operator merges it into the pod it builds
(:mod:`rolloutrun_operator.pod_templates`).

Why the protected fields are *declared* here: a field the schema does not know is pruned by
the API server (or refused as "unknown" without a reason). Declared, a value reaches the
operator, and validation refuses it naming the field and why, instead of dropping it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, ValidationInfo, field_validator

from rolloutrun_operator.api.common import (
    _LABEL_VALUE,
    DNS_SUBDOMAIN_PATTERN,
    EnvVar,
    ResourceRequirements,
    Toleration,
    _Model,
)

#: Free-form Kubernetes objects (affinity, volume sources): the API server validates them
#: on the pod; the CRD keeps them as they are.
_FREE_FORM: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}


def _free_form(schema: dict[str, Any]) -> None:
    schema.pop("additionalProperties", None)
    schema.update(_FREE_FORM, maxProperties=8)


def _free_form_items(schema: dict[str, Any]) -> None:
    schema["items"] = {"type": "object", "maxProperties": 16, **_FREE_FORM}


#: The Kubernetes types of the protected fields (so a value of the wrong type is refused by
#: the API server, one of the right type by validation, naming the field).
_STRING: dict[str, Any] = {"type": "string", "maxLength": 4096}
_OBJECT: dict[str, Any] = {"type": "object", "maxProperties": 64, **_FREE_FORM}
_BOOLEAN: dict[str, Any] = {"type": "boolean"}
_INTEGER: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 2**53}
_STRINGS: dict[str, Any] = {"type": "array", "maxItems": 1024, "items": _STRING}
_OBJECTS: dict[str, Any] = {"type": "array", "maxItems": 64, "items": _OBJECT}
#: A reserved free-form object.
RESERVED_OBJECT = _OBJECT


def reserved_schema(kube: dict[str, Any]) -> Any:
    """The schema of a declared field any value of which is refused: typed as in Kubernetes,
    so the API server keeps it (not pruned) and the refusal names it."""

    def replace(schema: dict[str, Any]) -> None:
        description = schema.get("description")
        schema.clear()
        schema.update(kube, description=description)

    return replace


def _protected(name: str, kube: dict[str, Any]) -> Any:
    """The field ``name`` the operator sets: declared so a value is refused by name, never
    pruned (:data:`PROTECTED_WHY` says why)."""
    return Field(
        None,
        description=f"Protected: {PROTECTED_WHY[name]}; a value here is refused.",
        json_schema_extra=reserved_schema(kube),
    )


#: Why each protected field is the operator's (the validation error quotes it).
PROTECTED_WHY: dict[str, str] = {
    "name": "the operator names member pods after the run and incarnation",
    "namespace": "member pods live in the run's namespace",
    "owner_references": "the run owns its pods (garbage collection, adoption checks)",
    "generate_name": "the operator names member pods after the run and incarnation",
    "finalizers": "the operator deletes and replaces member pods itself",
    "service_account_name": "set spec.serviceAccountName (the Lease RoleBinding follows it)",
    "automount_service_account_token": (
        "only the trainer gets a token (for its Lease); Gyms reach no API"
    ),
    "restart_policy": "member pods never restart in place; the operator starts an incarnation",
    "termination_grace_period_seconds": "set spec.trainer/gym.terminationGracePeriodSeconds",
    "image": "set spec.images",
    "image_pull_policy": "set spec.images.pullPolicy",
    "command": "the operator runs the member's entry point with the run's config",
    "args": "the operator runs the member's entry point with the run's config",
    "ports": "the operator sets the Gym and generation ports (spec.gym.port, generationPort)",
    "working_dir": "the member's working directory is the operator's work volume",
    "readiness_probe": "the operator's readiness decides when the trainer starts",
    "run_as_non_root": "member pods always run as non-root",
    "seccomp_profile": "member pods always run with the RuntimeDefault seccomp profile",
    "read_only_root_filesystem": "member containers always have a read-only root filesystem",
    "allow_privilege_escalation": "member containers never escalate privileges",
    "privileged": "member containers are never privileged",
    "capabilities": "member containers drop every capability",
}


def _refuse_protected(value: Any, info: ValidationInfo) -> Any:
    if value is not None:
        raise ValueError(f"protected: {PROTECTED_WHY[str(info.field_name)]}")
    return value


def _refuse(*names: str) -> Any:
    """The validator refusing any value of the protected fields ``names``."""
    return field_validator(*names)(_refuse_protected)


class TemplateMetadata(_Model):
    """Labels and annotations added to the member pods (not the operator's own keys)."""

    labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod labels; the operator's (rolloutrun.dev/*, managed-by) are refused.",
        json_schema_extra={"additionalProperties": _LABEL_VALUE},
    )
    annotations: dict[str, str] = Field(
        default_factory=dict,
        max_length=64,
        description="Extra pod annotations; keys under rolloutrun.dev/ are refused.",
        json_schema_extra={"additionalProperties": {"type": "string", "maxLength": 65_536}},
    )
    name: Any = _protected("name", _STRING)
    generate_name: Any = _protected("generate_name", _STRING)
    namespace: Any = _protected("namespace", _STRING)
    owner_references: Any = _protected("owner_references", _OBJECTS)
    finalizers: Any = _protected("finalizers", _STRINGS)

    _protected_fields = _refuse(
        "name", "generate_name", "namespace", "owner_references", "finalizers"
    )


class VolumeMount(_Model):
    """Where a template volume is mounted in the member container."""

    name: str = Field(..., min_length=1, max_length=63, description="A volume of the template.")
    mount_path: str = Field(..., min_length=1, max_length=4096, description="Absolute path.")
    sub_path: str | None = Field(None, max_length=4096, description="A path within the volume.")
    read_only: bool | None = Field(None, description="Mount read-only.")


class SELinuxOptions(_Model):
    """An SELinux context, as in a Pod."""

    user: str | None = Field(None, max_length=253, description="SELinux user.")
    role: str | None = Field(None, max_length=253, description="SELinux role.")
    type: str | None = Field(None, max_length=253, description="SELinux type.")
    level: str | None = Field(None, max_length=253, description="SELinux level.")


class ContainerSecurityContext(_Model):
    """Additions to the member container's security context (never a weaker one)."""

    run_as_user: int | None = Field(None, ge=1, le=2**31 - 1, description="A non-root UID.")
    run_as_group: int | None = Field(None, ge=0, le=2**31 - 1, description="The primary GID.")
    se_linux_options: SELinuxOptions | None = Field(
        None, description="SELinux user, role, type and level."
    )
    run_as_non_root: Any = _protected("run_as_non_root", _BOOLEAN)
    seccomp_profile: Any = _protected("seccomp_profile", _OBJECT)
    read_only_root_filesystem: Any = _protected("read_only_root_filesystem", _BOOLEAN)
    allow_privilege_escalation: Any = _protected("allow_privilege_escalation", _BOOLEAN)
    privileged: Any = _protected("privileged", _BOOLEAN)
    capabilities: Any = _protected("capabilities", _OBJECT)

    _protected_fields = _refuse(
        "run_as_non_root",
        "seccomp_profile",
        "read_only_root_filesystem",
        "allow_privilege_escalation",
        "privileged",
        "capabilities",
    )


class PodSecurityContext(_Model):
    """Additions to the member pod's security context (never a weaker one)."""

    run_as_user: int | None = Field(None, ge=1, le=2**31 - 1, description="A non-root UID.")
    run_as_group: int | None = Field(None, ge=0, le=2**31 - 1, description="The primary GID.")
    fs_group: int | None = Field(None, ge=0, le=2**31 - 1, description="Owner GID of volumes.")
    fs_group_change_policy: str | None = Field(
        None, pattern=r"^(OnRootMismatch|Always)$", max_length=16, description="When to chown."
    )
    supplemental_groups: list[Annotated[int, Field(ge=0, le=2**31 - 1)]] = Field(
        default_factory=list, max_length=32, description="Extra GIDs of the processes."
    )
    se_linux_options: SELinuxOptions | None = Field(
        None, description="SELinux user, role, type and level."
    )
    run_as_non_root: Any = _protected("run_as_non_root", _BOOLEAN)
    seccomp_profile: Any = _protected("seccomp_profile", _OBJECT)

    _protected_fields = _refuse("run_as_non_root", "seccomp_profile")


class TemplateContainer(_Model):
    """Additions to the member container, named as the operator names it (trainer, gym)."""

    name: str = Field(..., min_length=1, max_length=63, description="trainer or gym.")
    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements,
        description='Extra resources, e.g. limits {"nvidia.com/gpu": "8"}.',
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables."
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list, max_length=32, description="Mounts of the template's volumes."
    )
    security_context: ContainerSecurityContext | None = Field(
        None, description="Additions to the container's security context."
    )
    image: Any = _protected("image", _STRING)
    image_pull_policy: Any = _protected("image_pull_policy", _STRING)
    command: Any = _protected("command", _STRINGS)
    args: Any = _protected("args", _STRINGS)
    ports: Any = _protected("ports", _OBJECTS)
    working_dir: Any = _protected("working_dir", _STRING)
    readiness_probe: Any = _protected("readiness_probe", _OBJECT)

    _protected_fields = _refuse(
        "image", "image_pull_policy", "command", "args", "ports", "working_dir", "readiness_probe"
    )


class LocalObjectReference(_Model):
    """A Secret of the run's namespace (an image pull secret)."""

    name: str = Field(
        ..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="Its name."
    )


class TemplatePodSpec(_Model):
    """Additions to the member pod's spec."""

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels the pod must land on.",
        json_schema_extra={"additionalProperties": _LABEL_VALUE},
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the pod tolerates."
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="A Pod affinity (nodeAffinity, podAffinity, podAntiAffinity), as in a Pod.",
        json_schema_extra=_free_form,
    )
    priority_class_name: str | None = Field(
        None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN, description="A PriorityClass."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, max_length=16, description="Secrets to pull the images with."
    )
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=32,
        description=(
            "Extra volumes, as in a Pod (name plus one source); the operator's names (config, "
            "work, tmp, storage, gcs) are refused."
        ),
        json_schema_extra=_free_form_items,
    )
    security_context: PodSecurityContext | None = Field(
        None, description="Additions to the pod's security context."
    )
    containers: list[TemplateContainer] = Field(
        default_factory=list,
        max_length=1,
        description="Additions to the member container (one entry, named trainer or gym).",
    )
    service_account_name: Any = _protected("service_account_name", _STRING)
    automount_service_account_token: Any = _protected("automount_service_account_token", _BOOLEAN)
    restart_policy: Any = _protected("restart_policy", _STRING)
    termination_grace_period_seconds: Any = _protected("termination_grace_period_seconds", _INTEGER)

    _protected_fields = _refuse(
        "service_account_name",
        "automount_service_account_token",
        "restart_policy",
        "termination_grace_period_seconds",
    )

    @field_validator("volumes")
    @classmethod
    def _volumes_are_named(cls, volumes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for index, volume in enumerate(volumes):
            name = volume.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"volumes[{index}]: a volume needs a name")
        return volumes


class PodTemplate(_Model):
    """A subset of a PodTemplateSpec merged into the member pods the operator builds."""

    metadata: TemplateMetadata = Field(
        default_factory=TemplateMetadata, description="Extra labels and annotations."
    )
    spec: TemplatePodSpec = Field(
        default_factory=TemplatePodSpec,
        description="Scheduling, pull secrets, volumes, security additions, the container.",
    )
