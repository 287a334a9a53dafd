"""Pure builders of a run's children: plain Kubernetes manifests (dicts) from the RolloutRun.

Why pure: the reconcile decides *which* child to create, these functions decide *what* it
looks like, and neither talks to the API, so both are tested as tables and the same manifests
run on a real cluster and on the local cluster. Every child carries the run label and an
owner reference to the run (deleting the run garbage-collects them); member pods run as
non-root with a read-only root filesystem, no privilege escalation and no capabilities.

Endpoints without cluster DNS: the Gym pods start first; once their pod IPs are known the
trainer's RunConfig is rendered with ``gym.endpoints`` filled in, and the trainer tells each
Gym its own generation URL (``POD_IP`` + ``ROLLOUTRUN_GENERATION_PORT``) in every ``/run``.

The run's NetworkPolicies are built in network_policies.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml
from pydantic import BaseModel

from rolloutrun_operator import naming, pod_templates
from rolloutrun_operator.api.v1alpha1 import GROUP, KIND, VERSION, PodSettings, RolloutRun
from rolloutrun_runtime.contract.layout import AUDIT_FILE_SUFFIX, GYM_AUDIT_PREFIX
from rolloutrun_runtime.contract.pod import (
    ENV_GYM_PORT,
    ENV_METRICS_PORT,
    ENV_METRICS_TOKEN,
    METRICS_TOKEN_KEY,
    PORT_NAME_METRICS,
    TRAINER_METRICS_PORT,
    generation_slots,
)
from rolloutrun_runtime.contract.run_config import RunConfig, parse_run_config

Manifest = dict[str, Any]

RUN_AS_USER = 10001


def run_name(run: RolloutRun) -> str:
    return str(run.metadata["name"])


def run_namespace(run: RolloutRun) -> str:
    return str(run.metadata.get("namespace") or "default")


def owner_reference(run: RolloutRun) -> Manifest:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": run_name(run),
        "uid": str(run.metadata.get("uid", "")),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def metadata(run: RolloutRun, name: str, **labels: str) -> Manifest:
    return {
        "name": name,
        "namespace": run_namespace(run),
        "labels": {
            naming.LABEL_RUN: run_name(run),
            naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
            **labels,
        },
        "ownerReferences": [owner_reference(run)],
    }


# ----------------------------------------------------------- identity and coordination
def member_service_account(run: RolloutRun) -> Manifest:
    name = naming.member_account_name(run_name(run))
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": metadata(run, name)}


def member_role(run: RolloutRun) -> Manifest:
    """The trainer may read and renew its own run's Lease, nothing else.

    No ``create``: RBAC cannot restrict ``create`` by ``resourceNames``, so the operator
    creates the Lease (unheld) with the run and the trainer only ever updates it.
    """
    name = naming.member_account_name(run_name(run))
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(run, name),
        "rules": [
            {
                "apiGroups": ["coordination.k8s.io"],
                "resources": ["leases"],
                "resourceNames": [naming.lease_name(run_name(run))],
                "verbs": ["get", "update", "patch"],
            }
        ],
    }


def member_account(run: RolloutRun) -> str:
    """The ServiceAccount the member pods run as: ``spec.serviceAccountName`` or the run's."""
    return run.spec.service_account_name or naming.member_account_name(run_name(run))


def member_role_binding(run: RolloutRun, live: Iterable[str] = ()) -> Manifest:
    """Binds the member Role to the account the pods run as: the run's own, or the
    ``spec.serviceAccountName`` that opted in (so its trainer can renew the Lease too).

    ``live``: accounts of trainers still running (a spec that switched accounts takes effect
    at the next incarnation); they stay bound until their pods are gone, so a switch never
    cuts a renewing trainer off its Lease."""
    name = naming.member_account_name(run_name(run))
    accounts = sorted({member_account(run), *live})
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(run, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [
            {"kind": "ServiceAccount", "name": account, "namespace": run_namespace(run)}
            for account in accounts
        ],
    }


def trainer_lease(run: RolloutRun) -> Manifest:
    """The trainer Lease, created unheld; the trainer of each incarnation acquires it."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata(run, naming.lease_name(run_name(run))),
        "spec": {"leaseDurationSeconds": run.spec.recovery.lease_duration_seconds},
    }


def gym_token_secret(run: RolloutRun, token: str) -> Manifest:
    """The Gym control-plane token: the trainer sends it, the Gym servers require it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(run, naming.gym_token_secret_name(run_name(run))),
        "type": "Opaque",
        "stringData": {naming.GYM_TOKEN_KEY: token},
    }


def metrics_token_secret(run: RolloutRun, token: str) -> Manifest:
    """The metrics token: only the trainer's ``/metrics`` accepts it, only the trainer pod
    gets it (never a Gym), and the scraper reads it from this Secret (a PodMonitor's
    ``bearerTokenSecret``), so whoever may scrape cannot drive the data plane."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(run, naming.metrics_token_secret_name(run_name(run))),
        "type": "Opaque",
        "stringData": {METRICS_TOKEN_KEY: token},
    }


def referenced_secrets(run: RolloutRun) -> list[str]:
    """Secrets the user's spec names: they must exist before member pods can start."""
    names: list[str] = []
    for secret in (run.spec.storage.credentials_secret, run.spec.storage.gym_credentials_secret):
        if secret is not None:
            names.append(secret.name)
    for settings in (run.spec.trainer, run.spec.gym):
        template = settings.template
        extra = [v for c in template.spec.containers for v in c.env] if template else []
        for var in [*settings.env, *extra]:
            if var.value_from is not None and var.value_from.secret_key_ref is not None:
                names.append(var.value_from.secret_key_ref.name)
    return sorted(set(names))


# -------------------------------------------------------------------------- services
def trainer_service(run: RolloutRun) -> Manifest:
    port = run.spec.trainer.generation_port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(run, naming.trainer_service_name(run_name(run))),
        "spec": {
            "selector": {naming.LABEL_RUN: run_name(run), naming.LABEL_ROLE: naming.Role.TRAINER},
            "ports": [{"name": naming.PORT_NAME_GENERATION, "port": port, "targetPort": port}],
        },
    }


def gym_service(run: RolloutRun) -> Manifest:
    """Headless: lists the Gym pods for humans and tools; the trainer uses rendered IPs."""
    port = run.spec.gym.port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(run, naming.gym_service_name(run_name(run))),
        "spec": {
            "clusterIP": "None",
            "selector": {naming.LABEL_RUN: run_name(run), naming.LABEL_ROLE: naming.Role.GYM},
            "ports": [{"name": naming.PORT_NAME_GYM, "port": port, "targetPort": port}],
        },
    }


# ------------------------------------------------------------------------ run config
def render_run_config(
    run: RolloutRun, endpoints: list[str] | None = None, resume_from: str | None = None
) -> RunConfig:
    """``spec.run`` with what the operator owns filled in: name, replicas, storage, endpoints.

    ``resume_from`` (the Lease's latest manifest, which may lag the storage) is rendered as
    ``checkpointing.resumeHint``; a ``resumeFrom`` the user wrote stays theirs (a pin).
    """
    data = run.spec.run.to_yaml_dict()
    if "name" not in run.spec.run.model_fields_set:
        data["name"] = run_name(run)
    data.setdefault("gym", {})["replicas"] = run.spec.gym.replicas
    data["gym"]["standby"] = run.spec.gym.standby
    data["gym"]["endpoints"] = list(endpoints or [])
    if run.spec.workers.replicas:  # the generation actors go to the worker pods' nodes
        data.setdefault("workers", {})["workerNodes"] = run.spec.workers.replicas
        if run.spec.workers.standby:  # worker_pods.py: each standby pod offers a pod's slots
            data["workers"]["standbyWorkers"] = run.spec.workers.standby * generation_slots(
                run.spec.run.workers.generation_workers, run.spec.workers.replicas
            )
    checkpointing = data.setdefault("checkpointing", {})
    checkpointing["storageUri"] = run.spec.storage.uri
    if resume_from:
        checkpointing["resumeHint"] = resume_from
    else:
        checkpointing.pop("resumeHint", None)
    return parse_run_config(data, source=f"RolloutRun {run_name(run)}: spec.run")


def gym_endpoint(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    return f"http://{host}:{port}"


def config_data(
    run: RolloutRun, endpoints: list[str] | None, resume_from: str | None
) -> dict[str, str]:
    """The ConfigMap's data: the trainer's ``run.yaml`` and the Gym's ``gym.yaml``."""

    def dump(config: RunConfig) -> str:
        data = config.to_yaml_dict()
        if not config.workers.standby_workers:  # a runtime older than the field refuses it
            data.get("workers", {}).pop("standbyWorkers", None)
        if not config.gym.standby:  # likewise
            data.get("gym", {}).pop("standby", None)
        return yaml.safe_dump(data, sort_keys=True)

    data = {naming.GYM_CONFIG_KEY: dump(render_run_config(run, None, resume_from))}
    if endpoints is not None:
        data[naming.CONFIG_KEY] = dump(render_run_config(run, endpoints, resume_from))
    return data


def config_map(run: RolloutRun, data: dict[str, str], incarnation: int) -> Manifest:
    manifest: Manifest = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(run, naming.config_map_name(run_name(run))),
        "data": data,
    }
    manifest["metadata"]["annotations"] = {naming.ANNOTATION_CONFIG_INCARNATION: str(incarnation)}
    return manifest


# ------------------------------------------------------------------------------ pods
def _field_env(name: str, path: str) -> Manifest:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _common_env(run: RolloutRun, incarnation: int) -> list[Manifest]:
    return [
        {"name": naming.ENV_RUN_NAME, "value": run_name(run)},
        {"name": naming.ENV_INCARNATION, "value": str(incarnation)},
        _field_env(naming.ENV_POD_NAME, "metadata.name"),
        _field_env(naming.ENV_POD_NAMESPACE, "metadata.namespace"),
        _field_env(naming.ENV_POD_IP, "status.podIP"),
        {
            "name": naming.ENV_GYM_TOKEN,
            "valueFrom": {
                "secretKeyRef": {
                    "name": naming.gym_token_secret_name(run_name(run)),
                    "key": naming.GYM_TOKEN_KEY,
                }
            },
        },
    ]


def _resources(settings: PodSettings) -> Manifest:
    out: Manifest = {}
    if settings.resources.requests:
        out["requests"] = dict(settings.resources.requests)
    if settings.resources.limits:
        out["limits"] = dict(settings.resources.limits)
    return out


CONTAINER_SECURITY: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}
POD_SECURITY: Manifest = {
    "runAsNonRoot": True,
    "runAsUser": RUN_AS_USER,
    "runAsGroup": RUN_AS_USER,
    "fsGroup": RUN_AS_USER,
    "seccompProfile": {"type": "RuntimeDefault"},
}


def storage_credentials(run: RolloutRun, role: naming.Role) -> str | None:
    """The Secret with the gs:// key a member pod gets, or None (workload identity, file://).

    The trainer gets ``credentialsSecret``. A Gym only writes its side-effect records under
    ``<storage>/gym-audit/``, so it never gets the trainer's key: it gets
    ``gymCredentialsSecret`` (meant to be a key limited to that prefix), or nothing.
    """
    storage = run.spec.storage
    secret = (
        storage.credentials_secret
        if role is naming.Role.TRAINER
        else storage.gym_credentials_secret
    )
    return None if secret is None else secret.name


def _add_storage(
    run: RolloutRun,
    role: naming.Role,
    mounts: list[Manifest],
    volumes: list[Manifest],
    env: list[Manifest],
) -> None:
    """The run's storage in a member pod: GCS credentials, or the storage volume claim (a
    Gym mounts only the claim's ``gym-audit/`` directory, where it appends its audit)."""
    storage = run.spec.storage
    secret = storage_credentials(run, role)
    if secret is not None:
        mounts.append({"name": "gcs", "mountPath": naming.GCS_CREDENTIALS_DIR, "readOnly": True})
        volumes.append({"name": "gcs", "secret": {"secretName": secret}})
        env.append(
            {
                "name": naming.ENV_GOOGLE_CREDENTIALS,
                "value": f"{naming.GCS_CREDENTIALS_DIR}/{naming.GCS_CREDENTIALS_KEY}",
            }
        )
    if storage.volume_claim_name is not None:  # the trainer's checkpoints, the Gym's audit
        path = storage_path(storage.uri).rstrip("/")
        mount: Manifest = {"name": "storage", "mountPath": path}
        if role is not naming.Role.TRAINER:  # the kubelet creates the directory if missing
            mount = {
                **mount,
                "mountPath": f"{path}/{GYM_AUDIT_PREFIX}",
                "subPath": GYM_AUDIT_PREFIX,
            }
        mounts.append(mount)
        volumes.append(
            {"name": "storage", "persistentVolumeClaim": {"claimName": storage.volume_claim_name}}
        )


def _pod(
    run: RolloutRun,
    name: str,
    role: naming.Role,
    incarnation: int,
    settings: PodSettings,
    container: Manifest,
    config_key: str,
    extra_labels: dict[str, str],
) -> Manifest:
    mounts: list[Manifest] = [
        {"name": "config", "mountPath": naming.CONFIG_DIR, "readOnly": True},
        {"name": "work", "mountPath": naming.WORK_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[Manifest] = [
        {
            "name": "config",
            "configMap": {
                "name": naming.config_map_name(run_name(run)),
                "items": [{"key": config_key, "path": naming.CONFIG_KEY}],
            },
        },
        {"name": "work", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
    ]
    env = _common_env(run, incarnation)
    _add_storage(run, role, mounts, volumes, env)
    env.extend(
        var.model_dump(mode="json", by_alias=True, exclude_none=True) for var in settings.env
    )
    container = {
        **container,
        "image": run.spec.images.trainer if role is naming.Role.TRAINER else run.spec.images.gym,
        "imagePullPolicy": run.spec.images.pull_policy,
        "workingDir": naming.WORK_DIR,
        "env": env,
        "resources": _resources(settings),
        "volumeMounts": mounts,
        "securityContext": CONTAINER_SECURITY,
    }
    spec: Manifest = {
        "restartPolicy": "Never",
        "serviceAccountName": member_account(run),
        "automountServiceAccountToken": role is naming.Role.TRAINER,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_period_seconds,
        "securityContext": POD_SECURITY,
        "containers": [container],
        "volumes": volumes,
    }
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True)
            for t in settings.tolerations
        ]
    labels = {naming.LABEL_ROLE: str(role), naming.LABEL_INCARNATION: str(incarnation)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata(run, name, **labels, **extra_labels),
        "spec": spec,
    }


def _dump(model: BaseModel) -> Manifest:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


def storage_path(uri: str) -> str:
    """The local path of a ``file://`` (or bare path) storage URI."""
    return uri[len("file://") :] if uri.startswith("file://") else uri


def gym_audit_path(run: RolloutRun, index: int) -> str | None:
    """Where Gym replica ``index`` appends its applied side effects (JSON lines), file://.

    Under the run's ``file://`` storage (a directory every incarnation sees), so the audit
    survives pod deletion and a replacement replica reloads it (it refuses to apply an
    effect twice); ``rolloutrun audit <storage>/gym-audit --storage <uri>`` reads the
    ``gym-*.audit.jsonl`` files there, as it reads a local run's log dir. With ``gs://``
    storage: none (see :func:`gym_audit_uri`).
    """
    uri = run.spec.storage.uri
    if uri.startswith("gs://"):
        return None
    return f"{storage_path(uri).rstrip('/')}/{GYM_AUDIT_PREFIX}/gym-{index}{AUDIT_FILE_SUFFIX}"


def gym_audit_uri(run: RolloutRun) -> str | None:
    """With ``gs://`` storage: ``<storage uri>/gym-audit``, where every Gym replica writes
    one create-only object per side effect, keyed run-wide by rollout and revision
    (``rolloutrun gym --audit-uri``), before applying it; ``rolloutrun audit`` reads them
    there. Every replica, a replacement pod included, refuses what any replica applied.
    """
    uri = run.spec.storage.uri
    if not uri.startswith("gs://"):
        return None
    return f"{uri.rstrip('/')}/{GYM_AUDIT_PREFIX}"


def trainer_pod(run: RolloutRun, incarnation: int) -> Manifest:
    """The trainer: single controller plus policy workers; holds the run's Lease."""
    name = run_name(run)
    port = run.spec.trainer.generation_port
    container = {
        "name": "trainer",
        "command": ["rolloutrun", "trainer", "--config", naming.CONFIG_PATH],
        "ports": [
            {"name": naming.PORT_NAME_GENERATION, "containerPort": port},
            {"name": PORT_NAME_METRICS, "containerPort": TRAINER_METRICS_PORT},
        ],
        # why it failed, in the pod's status (the operator quotes it when the run fails)
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    pod = _pod(
        run,
        naming.trainer_pod_name(name, incarnation),
        naming.Role.TRAINER,
        incarnation,
        run.spec.trainer,
        container,
        naming.CONFIG_KEY,
        {},
    )
    pod["spec"]["containers"][0]["env"][0:0] = [
        {"name": naming.ENV_LEASE_NAME, "value": naming.lease_name(name)},
        {
            "name": naming.ENV_LEASE_DURATION,
            "value": str(run.spec.recovery.lease_duration_seconds),
        },
        {"name": naming.ENV_GENERATION_PORT, "value": str(port)},
        {"name": ENV_METRICS_PORT, "value": str(TRAINER_METRICS_PORT)},
        {
            "name": ENV_METRICS_TOKEN,
            "valueFrom": {
                "secretKeyRef": {
                    "name": naming.metrics_token_secret_name(name),
                    "key": METRICS_TOKEN_KEY,
                }
            },
        },
    ]
    return shape(pod, run.spec.trainer, "spec.trainer")


def gym_pod(run: RolloutRun, incarnation: int, index: int, generation: int = 0) -> Manifest:
    """Gym replica ``index``: the same stable instance id in every incarnation; a
    replacement within the incarnation has the same name and the next member generation."""
    name = run_name(run)
    port = run.spec.gym.port
    instance = naming.gym_instance_id(name, index)
    container: Manifest = {
        "name": "gym",
        "command": [
            "rolloutrun",
            "gym",
            "--config",
            naming.CONFIG_PATH,
            "--host",
            f"$({naming.ENV_POD_IP})",
            "--port",
            str(port),
            "--instance-id",
            instance,
        ],
        "ports": [{"name": naming.PORT_NAME_GYM, "containerPort": port}],
        "readinessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 1},
        # why it failed, in the pod's status (the operator quotes its last line)
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    audit = gym_audit_path(run, index)
    if audit is not None:
        container["command"] += ["--audit-file", audit]
    audit_uri = gym_audit_uri(run)
    if audit_uri is not None:
        container["command"] += ["--audit-uri", audit_uri]
    if run.spec.gym.command is not None:  # the user's own server (environment-contract.md)
        container["command"] = list(run.spec.gym.command)
        if run.spec.gym.args:
            container["args"] = list(run.spec.gym.args)
    pod = _pod(
        run,
        naming.gym_pod_name(name, incarnation, index),
        naming.Role.GYM,
        incarnation,
        run.spec.gym,
        container,
        naming.GYM_CONFIG_KEY,
        {naming.LABEL_GYM_INDEX: str(index), naming.LABEL_MEMBER_GENERATION: str(generation)},
    )
    gym = pod["spec"]["containers"][0]
    gym["env"].insert(0, {"name": naming.ENV_GYM_INSTANCE_ID, "value": instance})
    gym["env"].insert(1, {"name": ENV_GYM_PORT, "value": str(port)})
    if run.spec.gym.image is not None:
        gym["image"] = run.spec.gym.image
    return shape(pod, run.spec.gym, "spec.gym")


def shape(pod: Manifest, settings: PodSettings, where: str) -> Manifest:
    """The member pod with ``settings.template`` merged in (:mod:`pod_templates`); raises
    :class:`~rolloutrun_operator.pod_templates.TemplateConflict`, which validation reports
    before any pod is built."""
    if settings.template is None:
        return pod
    return pod_templates.merge_template(pod, settings.template, f"{where}.template")
