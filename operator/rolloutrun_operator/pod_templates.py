"""Merge a user's pod template (``spec.trainer.template``, ``spec.gym.template``) into a member pod.

Why a merge and not an overlay: the pod the builders make carries the run's contract (the
labels the operator selects on, the command, the ports, the Lease and env contract, the
storage mount, the security context, the token mount, the owner reference); the template
only *adds* what a platform needs: labels, annotations, scheduling (node selector,
tolerations, affinity, priority class), image pull secrets, volumes and their mounts,
resources such as ``nvidia.com/gpu``, environment variables, security-context additions.

Why refuse instead of letting either side win: a template key that collides with the
operator's silently breaks fencing or discovery if it wins, and silently does nothing if it
loses. Every collision is a problem line naming the template's field and why; fields the
operator always sets are refused earlier, by the models
(:mod:`~rolloutrun_operator.api.pod_template`). Pure: a pod and a template in, a new pod out.
"""

from __future__ import annotations

import copy
from typing import Any

from rolloutrun_operator import kube_names, naming
from rolloutrun_operator.api.pod_template import PodTemplate
from rolloutrun_runtime.contract.pod import RESERVED_ENV

Manifest = dict[str, Any]

#: Label and annotation keys in the operator's own domains (its labels, Kopf's state).
PROTECTED_KEY_PREFIXES = (f"{naming.GROUP}/", f"{naming.KOPF_ANNOTATION_PREFIX}/")


class TemplateConflict(ValueError):
    """A pod template collides with what the operator sets; ``problems``: ``path: why``."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


def _key_problems(
    where: str, kind: str, wanted: dict[str, str], taken: dict[str, str]
) -> list[str]:
    problems = []
    for key, value in wanted.items():
        path = f"{where}.metadata.{kind}[{key!r}]"
        if key in taken or key.startswith(PROTECTED_KEY_PREFIXES):
            problems.append(f"{path}: protected, the operator sets the pod's {kind[:-1]} {key!r}")
            continue
        errors = kube_names.is_qualified_name(key.rpartition("/")[2])
        if kind == "labels":
            errors += kube_names.is_label_value(value)
        problems += [f"{path}: {error}" for error in errors]
    return problems


def _resource_kinds(entry: Any) -> list[tuple[str, dict[str, str]]]:
    return [("requests", entry.resources.requests), ("limits", entry.resources.limits)]


def _within(path: str, parent: str) -> bool:
    parent = parent.rstrip("/")
    return path.rstrip("/") == parent or path.startswith(f"{parent}/")


def _container_problems(
    where: str, settings: str, template: PodTemplate, container: Manifest, volumes: set[str]
) -> list[str]:
    """The template's container entry against the operator's container."""
    problems: list[str] = []
    for index, entry in enumerate(template.spec.containers):
        path = f"{where}.spec.containers.{index}"
        if entry.name != container["name"]:
            problems.append(
                f"{path}.name: {entry.name!r} is no container of this pod; "
                f"the member container is {container['name']!r}"
            )
        resources = container.get("resources", {})
        for kind, wanted in _resource_kinds(entry):
            for key in sorted(set(wanted) & set(resources.get(kind, {}))):
                problems.append(
                    f"{path}.resources.{kind}[{key!r}]: also set by {settings}.resources; "
                    "set it in one place"
                )
        env = {var["name"] for var in container.get("env", [])}
        for position, var in enumerate(entry.env):
            if var.name in RESERVED_ENV:
                problems.append(
                    f"{path}.env.{position}.name: {var.name!r} is reserved, the operator "
                    "sets it on every member pod"
                )
            elif var.name in env:
                problems.append(
                    f"{path}.env.{position}.name: {var.name!r} is also set by "
                    f"{settings}.env; set it in one place"
                )
        for position, mount in enumerate(entry.volume_mounts):
            mount_path = f"{path}.volumeMounts.{position}"
            if mount.name not in volumes:
                problems.append(
                    f"{mount_path}.name: {mount.name!r} is no volume of {where}.spec.volumes "
                    "(the operator's own volumes cannot be mounted again)"
                )
            if not mount.mount_path.startswith("/"):
                problems.append(f"{mount_path}.mountPath: {mount.mount_path!r} is not absolute")
            for taken in container.get("volumeMounts", []):
                if _within(mount.mount_path, taken["mountPath"]):
                    problems.append(
                        f"{mount_path}.mountPath: {mount.mount_path!r} lies in the operator's "
                        f"mount {taken['mountPath']!r} (volume {taken['name']!r}): protected"
                    )
    return problems


def template_problems(pod: Manifest, template: PodTemplate, where: str) -> list[str]:
    """Every collision of ``template`` (at field path ``where``, e.g.
    ``spec.trainer.template``) with the operator's ``pod``, as ``path: why`` lines."""
    settings = where.rpartition(".")[0]
    meta, spec = pod["metadata"], pod["spec"]
    problems = _key_problems(where, "labels", template.metadata.labels, meta.get("labels", {}))
    problems += _key_problems(
        where, "annotations", template.metadata.annotations, meta.get("annotations", {})
    )
    for key in sorted(set(template.spec.node_selector) & set(spec.get("nodeSelector", {}))):
        problems.append(
            f"{where}.spec.nodeSelector[{key!r}]: also set by {settings}.nodeSelector; "
            "set it in one place"
        )
    operator_volumes = {volume["name"] for volume in spec.get("volumes", [])}
    volumes: set[str] = set()
    for index, volume in enumerate(template.spec.volumes):
        name = str(volume["name"])
        path = f"{where}.spec.volumes.{index}.name"
        if name in operator_volumes:
            problems.append(
                f"{path}: {name!r} is protected, the operator's volumes are "
                f"{', '.join(sorted(operator_volumes))}"
            )
        elif name in volumes:
            problems.append(f"{path}: {name!r} is named twice")
        problems += [f"{path}: {error}" for error in kube_names.is_dns1123_label(name)]
        volumes.add(name)
    container = spec["containers"][0]
    return problems + _container_problems(where, settings, template, container, volumes)


def _dump(models: list[Any]) -> list[Manifest]:
    return [model.model_dump(mode="json", by_alias=True, exclude_none=True) for model in models]


def _merge_container(container: Manifest, template: PodTemplate) -> None:
    for entry in template.spec.containers:
        resources = container.setdefault("resources", {})
        for kind, wanted in _resource_kinds(entry):
            if wanted:
                resources[kind] = {**resources.get(kind, {}), **wanted}
        container["env"] = [*container.get("env", []), *_dump(entry.env)]
        container["volumeMounts"] = [
            *container.get("volumeMounts", []),
            *_dump(entry.volume_mounts),
        ]
        if entry.security_context is not None:
            additions = entry.security_context.model_dump(
                mode="json", by_alias=True, exclude_none=True
            )
            container["securityContext"] = {**container.get("securityContext", {}), **additions}


def merge_template(pod: Manifest, template: PodTemplate, where: str) -> Manifest:
    """``pod`` with ``template`` merged in; :class:`TemplateConflict` on any collision."""
    problems = template_problems(pod, template, where)
    if problems:
        raise TemplateConflict(problems)
    pod = copy.deepcopy(pod)
    meta, spec, shape = pod["metadata"], pod["spec"], template.spec
    if template.metadata.labels:
        meta["labels"] = {**meta.get("labels", {}), **template.metadata.labels}
    if template.metadata.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **template.metadata.annotations}
    if shape.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **shape.node_selector}
    if shape.tolerations:
        spec["tolerations"] = [*spec.get("tolerations", []), *_dump(shape.tolerations)]
    if shape.affinity:
        spec["affinity"] = copy.deepcopy(shape.affinity)
    if shape.priority_class_name is not None:
        spec["priorityClassName"] = shape.priority_class_name
    if shape.image_pull_secrets:
        spec["imagePullSecrets"] = _dump(shape.image_pull_secrets)
    if shape.volumes:
        spec["volumes"] = [*spec.get("volumes", []), *copy.deepcopy(shape.volumes)]
    if shape.security_context is not None:
        additions = shape.security_context.model_dump(
            mode="json", by_alias=True, exclude_none=True, exclude_defaults=True
        )
        spec["securityContext"] = {**spec.get("securityContext", {}), **additions}
    _merge_container(spec["containers"][0], template)
    return pod
