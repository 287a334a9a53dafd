"""The child builders: valid Kubernetes manifests, owned by the run, carrying the pod contract."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from rolloutrun_operator import builders, naming, network_policies
from rolloutrun_runtime.contract.pod import ENV_GYM_PORT, ENV_METRICS_TOKEN, METRICS_TOKEN_KEY
from rolloutrun_runtime.contract.run_config import RunConfig
from tests.support.rolloutruns import make_run

K8S_VERSION = "1.33.0"


def everything(run):
    data = builders.config_data(run, ["http://127.0.0.10:8000", "http://127.0.0.11:8000"], None)
    return [
        builders.member_service_account(run),
        builders.member_role(run),
        builders.member_role_binding(run),
        builders.trainer_lease(run),
        builders.gym_token_secret(run, "secret-token"),
        builders.metrics_token_secret(run, "metrics-token"),
        builders.trainer_service(run),
        builders.gym_service(run),
        network_policies.gym_network_policy(run),
        network_policies.generation_network_policy(run),
        builders.config_map(run, data, 3),
        builders.trainer_pod(run, 3),
        builders.gym_pod(run, 3, 0),
        builders.gym_pod(run, 3, 1),
    ]


CLAIMED = {"uri": "file:///data/demo", "volumeClaimName": "demo-storage"}
GCS = {
    "storage": {"uri": "gs://bucket-x/runs", "credentialsSecret": {"name": "gcs-key"}},
    "trainer": {
        "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "2"}},
        "nodeSelector": {"pool": "spot"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
    },
}


@pytest.mark.parametrize(
    "spec", [{}, GCS, {"storage": {"uri": "file:///data/x", "volumeClaimName": "ckpt"}}]
)
def test_every_child_is_a_valid_kubernetes_object_owned_by_the_run(spec):
    run = make_run(**spec)
    for manifest in everything(run):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
        meta = manifest["metadata"]
        assert meta["namespace"] == "ns"
        assert meta["labels"][naming.LABEL_RUN] == "demo"
        (owner,) = meta["ownerReferences"]
        assert owner == {
            "apiVersion": "rolloutrun.dev/v1alpha1",
            "kind": "RolloutRun",
            "name": "demo",
            "uid": "uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }


def env_of(pod):
    return {var["name"]: var for var in pod["spec"]["containers"][0]["env"]}


def test_the_trainer_pod_carries_the_contract():
    pod = builders.trainer_pod(make_run(**GCS), 3)
    assert pod["metadata"]["name"] == "demo-i3-trainer"
    labels = pod["metadata"]["labels"]
    assert labels[naming.LABEL_ROLE] == "trainer" and labels[naming.LABEL_INCARNATION] == "3"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["rolloutrun", "trainer", "--config", "/etc/rolloutrun/run.yaml"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    env = env_of(pod)
    assert env["ROLLOUTRUN_INCARNATION"]["value"] == "3"
    assert env["ROLLOUTRUN_LEASE_NAME"]["value"] == "demo-trainer"
    assert env["ROLLOUTRUN_LEASE_DURATION_SECONDS"]["value"] == "15"
    assert env["ROLLOUTRUN_GENERATION_PORT"]["value"] == "8100"
    # the trainer's Prometheus /metrics: a named container port, and the port in its env
    assert {"name": "metrics", "containerPort": 9464} in container["ports"]
    assert env["ROLLOUTRUN_METRICS_PORT"]["value"] == "9464"
    # ... behind the run's metrics token (its own Secret: it opens /metrics only)
    assert env["ROLLOUTRUN_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "demo-metrics-token",
        "key": "token",
    }
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["ROLLOUTRUN_GYM_CONTROL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "demo-gym-token",
        "key": "token",
    }
    assert env["GOOGLE_APPLICATION_CREDENTIALS"]["value"].endswith("/credentials.json")
    assert env["K"]["valueFrom"]["secretKeyRef"]["name"] == "s"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["items"] == [{"key": "run.yaml", "path": "run.yaml"}]
    assert volumes["gcs"]["secret"]["secretName"] == "gcs-key"
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["serviceAccountName"] == "demo-member"
    assert spec["automountServiceAccountToken"] is True
    assert spec["nodeSelector"] == {"pool": "spot"}
    assert spec["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "2"}}


def test_the_metrics_token_is_its_own_secret_and_reaches_the_trainer_only():
    run = make_run(**GCS)
    secret = builders.metrics_token_secret(run, "metrics-token")
    assert secret["metadata"]["name"] == naming.metrics_token_secret_name("demo")
    assert secret["stringData"] == {METRICS_TOKEN_KEY: "metrics-token"}
    assert secret["metadata"]["name"] != naming.gym_token_secret_name("demo")
    gym = builders.gym_pod(run, 1, 0)
    assert ENV_METRICS_TOKEN not in env_of(gym)
    assert "demo-metrics-token" not in yaml.safe_dump(gym)  # no env, no volume: not at all


@pytest.mark.parametrize(
    "maker", [lambda r: builders.trainer_pod(r, 1), lambda r: builders.gym_pod(r, 1, 0)]
)
def test_member_pods_run_non_root_read_only_without_privileges(maker):
    pod = maker(make_run())
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    security = pod["spec"]["containers"][0]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    mounts = {m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert {"/tmp", naming.WORK_DIR} <= mounts


def test_gym_pods_keep_a_stable_instance_id_across_incarnations():
    run = make_run()
    first, later = builders.gym_pod(run, 1, 1), builders.gym_pod(run, 7, 1)
    assert (
        first["metadata"]["name"] == "demo-i1-gym-1"
        and later["metadata"]["name"] == "demo-i7-gym-1"
    )
    for pod in (first, later):
        command = pod["spec"]["containers"][0]["command"]
        assert command == [
            "rolloutrun",
            "gym",
            "--config",
            "/etc/rolloutrun/run.yaml",
            "--host",
            "$(POD_IP)",  # expanded by the kubelet from the downward API: the pod's own IP
            "--port",
            "8000",
            "--instance-id",
            "demo-gym-1",
            "--audit-file",  # under the file:// storage: it survives the pod
            "/data/demo/gym-audit/gym-1.audit.jsonl",
        ]
        assert env_of(pod)["ROLLOUTRUN_GYM_INSTANCE_ID"]["value"] == "demo-gym-1"
        assert pod["metadata"]["labels"][naming.LABEL_GYM_INDEX] == "1"
        assert pod["spec"]["automountServiceAccountToken"] is False
    volumes = {v["name"]: v for v in first["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["items"] == [{"key": "gym.yaml", "path": "run.yaml"}]


def test_the_member_role_reaches_only_the_runs_own_lease():
    (rule,) = builders.member_role(make_run())["rules"]
    assert rule == {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["demo-trainer"],
        "verbs": ["get", "update", "patch"],
    }


def test_the_rendered_config_is_a_bare_run_config_with_what_the_operator_owns():
    run = make_run(gym={"replicas": 2}, storage=CLAIMED)
    data = builders.config_data(
        run, ["http://127.0.0.10:8000", "http://127.0.0.11:8000"], "file:///data/demo/m.json"
    )
    trainer = RunConfig.model_validate(yaml.safe_load(data["run.yaml"]))
    gym = RunConfig.model_validate(yaml.safe_load(data["gym.yaml"]))
    assert trainer.name == "demo"
    assert trainer.gym.endpoints == ["http://127.0.0.10:8000", "http://127.0.0.11:8000"]
    assert trainer.gym.replicas == 2
    assert trainer.checkpointing.storage_uri == "file:///data/demo"
    # the Lease's manifest is a hint (it may lag the storage), never the user's pin
    assert trainer.checkpointing.resume_hint == "file:///data/demo/m.json"
    assert trainer.checkpointing.resume_from is None
    assert trainer.grpo.max_steps == 30
    assert gym.gym.endpoints == [] and gym.checkpointing.resume_hint == "file:///data/demo/m.json"
    fresh = builders.config_data(run, None, None)
    assert set(fresh) == {"gym.yaml"}
    assert "resumeHint" not in yaml.safe_load(fresh["gym.yaml"])["checkpointing"]


def test_a_resume_pin_the_user_wrote_survives_the_operators_hint():
    run = make_run(
        storage=CLAIMED,
        run={"checkpointing": {"resumeFrom": "file:///data/demo/step_4"}},
    )
    for hint in ("file:///data/demo/m.json", None):
        data = builders.config_data(run, ["http://127.0.0.10:8000", "http://127.0.0.11:8000"], hint)
        trainer = RunConfig.model_validate(yaml.safe_load(data["run.yaml"]))
        assert trainer.checkpointing.resume_from == "file:///data/demo/step_4"
        assert trainer.checkpointing.resume_hint == hint


def test_an_explicit_run_name_wins_and_ipv6_endpoints_are_bracketed():
    run = make_run(run={"name": "custom"})
    assert builders.render_run_config(run).name == "custom"
    assert builders.gym_endpoint("fd00::5", 8000) == "http://[fd00::5]:8000"


def test_a_volume_claim_is_mounted_at_the_storage_path_of_the_trainer():
    run = make_run(storage={"uri": "file:///data/x", "volumeClaimName": "ckpt"})
    pod = builders.trainer_pod(run, 1)
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["storage"] == "/data/x"
    command = builders.gym_pod(run, 1, 0)["spec"]["containers"][0]["command"]
    assert command[-2:] == ["--audit-file", "/data/x/gym-audit/gym-0.audit.jsonl"]
    assert "--audit-uri" not in command


def test_a_failed_gym_says_why_in_its_status_as_the_trainer_does():
    """A Gym that exits (its launcher refused a mount, its server raised) leaves its log's
    end as its termination message, which the operator quotes in the run's lastFailure."""
    container = builders.gym_pod(make_run(), 1, 0)["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_gym_pods_record_side_effects_under_the_gcs_storage_without_the_trainers_key():
    run = make_run(**GCS)
    pod = builders.gym_pod(run, 1, 0)
    command = pod["spec"]["containers"][0]["command"]
    assert "--audit-file" not in command
    # Every Gym replica writes under <storage>/gym-audit/, keyed run-wide: any replica, a
    # replacement pod included, refuses what another applied.
    assert command[-2:] == ["--audit-uri", "gs://bucket-x/runs/gym-audit"]
    assert builders.gym_pod(run, 4, 1)["spec"]["containers"][0]["command"][-2:] == command[-2:]
    # The trainer's key (read/write/delete on checkpoints) never reaches a Gym.
    assert "gcs" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env_of(pod)
    trainer = builders.trainer_pod(run, 1)
    assert {v["name"]: v for v in trainer["spec"]["volumes"]}["gcs"]["secret"] == {
        "secretName": "gcs-key"
    }
    # Still no Kubernetes API token: the Gym needs storage, not the API.
    assert pod["spec"]["automountServiceAccountToken"] is False


def test_gym_pods_get_only_the_gym_credentials_secret():
    storage = {**GCS["storage"], "gymCredentialsSecret": {"name": "gym-audit-key"}}
    run = make_run(storage=storage)
    pod = builders.gym_pod(run, 1, 0)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["gcs"]["secret"] == {"secretName": "gym-audit-key"}
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["gcs"] == {
        "name": "gcs",
        "mountPath": naming.GCS_CREDENTIALS_DIR,
        "readOnly": True,
    }
    assert env_of(pod)["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == (
        f"{naming.GCS_CREDENTIALS_DIR}/{naming.GCS_CREDENTIALS_KEY}"
    )
    trainer = builders.trainer_pod(run, 1)
    assert {v["name"]: v for v in trainer["spec"]["volumes"]}["gcs"]["secret"] == {
        "secretName": "gcs-key"
    }
    # both must exist before the members start
    assert builders.referenced_secrets(run) == ["gcs-key", "gym-audit-key"]
    for manifest in (pod, trainer):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def test_gym_pods_of_a_file_run_get_no_credential_and_only_the_audit_directory():
    run = make_run(storage={"uri": "file:///data/x/", "volumeClaimName": "ckpt"})
    pod = builders.gym_pod(run, 1, 0)
    (storage,) = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "storage"]
    # the claim's gym-audit/ directory only: not the checkpoints beside it
    assert storage == {"name": "storage", "mountPath": "/data/x/gym-audit", "subPath": "gym-audit"}
    audit = pod["spec"]["containers"][0]["command"][-1]
    assert audit.startswith(storage["mountPath"] + "/")
    assert "gcs" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env_of(pod)
    assert pod["spec"]["automountServiceAccountToken"] is False
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_a_gym_credentials_secret_on_file_storage_is_unusable():
    from rolloutrun_operator.problems import storage_problem

    run = make_run(
        storage={
            "uri": "file:///data/x",
            "volumeClaimName": "c",
            "gymCredentialsSecret": {"name": "k"},
        }
    )
    assert storage_problem(run) == "storage.gymCredentialsSecret is for gs:// storage, not file://"


def test_gym_pods_without_a_credentials_secret_get_no_gcs_volume():
    run = make_run(storage={"uri": "gs://bucket-x/runs"})  # workload identity
    pod = builders.gym_pod(run, 1, 0)
    assert pod["spec"]["containers"][0]["command"][-2:] == [
        "--audit-uri",
        "gs://bucket-x/runs/gym-audit",
    ]
    assert "gcs" not in {v["name"] for v in pod["spec"]["volumes"]}
    assert "GOOGLE_APPLICATION_CREDENTIALS" not in env_of(pod)


def test_referenced_secrets_are_listed_once():
    assert builders.referenced_secrets(make_run(**GCS)) == ["gcs-key", "s"]
    assert builders.referenced_secrets(make_run()) == []


USER_GYM = {
    "image": "registry.example/times-table:1",
    "command": ["python", "/env/server.py"],
    "args": ["--host", "$(POD_IP)", "--port", "$(ROLLOUTRUN_GYM_PORT)"],
}


def test_a_users_environment_server_runs_its_own_image_and_command():
    run = make_run(gym=USER_GYM)
    pod = builders.gym_pod(run, 2, 1)
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    (container,) = pod["spec"]["containers"]
    assert container["image"] == USER_GYM["image"]
    assert container["command"] == USER_GYM["command"]
    assert container["args"] == USER_GYM["args"]
    env = env_of(pod)
    assert env[ENV_GYM_PORT]["value"] == str(run.spec.gym.port)
    assert env[naming.ENV_GYM_INSTANCE_ID]["value"] == naming.gym_instance_id("demo", 1)
    # The contract's token and the rendered config reach it as they reach the built-in Gym.
    assert naming.ENV_GYM_TOKEN in env
    # The built-in Gym keeps its command and the run's image.
    builtin = builders.gym_pod(make_run(), 2, 1)["spec"]["containers"][0]
    assert builtin["command"][:2] == ["rolloutrun", "gym"] and "args" not in builtin
    assert builtin["image"] == run.spec.images.gym
