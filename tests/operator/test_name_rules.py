"""The API server's naming rules, reserved env names and mount paths, checked offline; the
handlers' failure reporting (reason, message, backoff) as pure functions."""

from __future__ import annotations

import copy
import datetime as dt
import subprocess
import sys

import pytest
import yaml

from rolloutrun_operator import builders, name_rules, naming
from rolloutrun_operator.api.validation import RolloutRunInvalid, parse_rolloutrun
from rolloutrun_operator.conditions import failure_patch
from rolloutrun_operator.handlers import MAX_RETRY_SECONDS, describe_failure, retry_delay
from rolloutrun_operator.kube import KubeError
from rolloutrun_runtime.contract import pod as contract_pod
from tests.support.rolloutruns import BASE

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


@pytest.mark.parametrize(
    ("check", "name", "ok"),
    [
        (name_rules.dns1035_label_problem, "demo-trainer", True),
        (name_rules.dns1035_label_problem, "7b-grpo-trainer", False),  # starts with a digit
        (name_rules.dns1035_label_problem, "a" * 63, True),
        (name_rules.dns1035_label_problem, "a" * 64, False),
        (name_rules.dns1035_label_problem, "a.b", False),
        (name_rules.dns1035_label_problem, "ab-", False),
        (name_rules.dns1123_label_problem, "7b-grpo-i1-trainer", True),
        (name_rules.dns1123_label_problem, "Demo", False),
        (name_rules.dns1123_label_problem, "a" * 64, False),
        (name_rules.dns1123_subdomain_problem, "7b.grpo-config", True),
        (name_rules.dns1123_subdomain_problem, "a" * 253, True),
        (name_rules.dns1123_subdomain_problem, "a" * 254, False),
        (name_rules.dns1123_subdomain_problem, "a..b", False),
        (name_rules.dns1123_subdomain_problem, "", False),
        (name_rules.label_value_problem, "", True),
        (name_rules.label_value_problem, "A_b.c-9", True),
        (name_rules.label_value_problem, "a" * 64, False),
        (name_rules.label_value_problem, "-a", False),
    ],
)
def test_each_rule_is_the_api_servers(check, name, ok):
    assert (check(name) is None) is ok


@pytest.mark.parametrize(
    ("run", "replicas", "named"),
    [
        ("7b-grpo", 2, ["trainer Service name '7b-grpo-trainer' must be a DNS-1035 label"]),
        ("a" * 60, 2, ["'" + "a" * 60 + "-trainer' must be a DNS-1035 label: 68 characters"]),
        ("a" * 64, 2, ["label rolloutrun.dev/run value", "64 characters, at most 63"]),
        ("a" * 49, 2, ["trainer pod name", "-i99999-trainer", "at most 48 characters"]),
        ("a" * 48, 1024, ["Gym pod name", "-i99999-gym-1023", "at most 47 characters"]),
        ("run.v2", 2, ["Service name 'run.v2-gym' must be a DNS-1035 label"]),
    ],
)
def test_every_derived_name_is_checked_naming_the_rule_and_the_name(run, replicas, named):
    problems = "\n".join(name_rules.run_name_problems(run, replicas))
    for words in named:
        assert words in problems


def test_the_longest_allowed_name_fits_every_derived_name():
    for replicas in (1, 2, 10, 1024):
        longest = "a" * name_rules.max_run_name(replicas)
        assert name_rules.run_name_problems(longest, replicas) == []
        assert name_rules.run_name_problems(longest + "a", replicas) != []


def test_every_name_the_builders_give_is_in_the_checked_list():
    run = parse_rolloutrun(document("x"))
    built = {m["metadata"]["name"] for m in builders_static(run)}
    checked = {name for _what, name, _check in name_rules.derived_names("x", 2)}
    assert built <= checked


def builders_static(run):
    from rolloutrun_operator.reconcile import static_children

    return [*static_children(run, token="t"), builders.config_map(run, {}, 1)]


def document(name: str, **spec) -> dict:
    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


@pytest.mark.parametrize("name", ["7b-grpo", "a" * 60])
def test_validation_refuses_a_name_the_api_server_would(name):
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(document(name))
    assert any(p.startswith("metadata.name: ") for p in caught.value.problems)


@pytest.mark.parametrize("path", ["/tmp", "/tmp/", "/var/lib/rolloutrun", "/var", "/etc"])
def test_a_claim_over_the_pods_own_mounts_is_refused(path):
    storage = {"uri": f"file://{path}", "volumeClaimName": "ckpt"}
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(document("demo", storage=storage))
    assert "spec.storage.uri" in str(caught.value) and "mounted over" in str(caught.value)


def test_a_claim_inside_the_read_only_config_is_refused_and_elsewhere_accepted():
    inside = {"uri": "file:///etc/rolloutrun/ckpt", "volumeClaimName": "ckpt"}
    with pytest.raises(RolloutRunInvalid, match="read-only"):
        parse_rolloutrun(document("demo", storage=inside))
    for path in ("/data/ckpt", "/tmp/ckpt", "/tmpdata"):
        parse_rolloutrun(
            document("demo", storage={"uri": f"file://{path}", "volumeClaimName": "c"})
        )


@pytest.mark.parametrize("uri", ["file:///tmp", "file:///data/ckpt", "/data/ckpt"])
def test_file_storage_without_a_claim_is_refused_naming_the_field_and_why(uri):
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(document("demo", storage={"uri": uri}))
    (problem,) = caught.value.problems
    assert problem.startswith("spec.storage.volumeClaimName: required with file:// storage")
    assert "dies with the pod" in problem and "PersistentVolumeClaim" in problem
    parse_rolloutrun(document("demo", storage={"uri": "gs://bucket/runs"}))  # no claim needed


def test_the_own_mount_list_is_what_the_builders_mount():
    run = parse_rolloutrun(document("demo"))
    for pod in (builders.trainer_pod(run, 1), builders.gym_pod(run, 1, 0)):
        mounts = {
            m["mountPath"]
            for m in pod["spec"]["containers"][0]["volumeMounts"]
            if m["name"] != "storage"  # the run's claim, at the user's storage path
        }
        assert mounts == set(name_rules.OWN_MOUNT_PATHS)


@pytest.mark.parametrize("settings", ["trainer", "gym"])
@pytest.mark.parametrize("variable", sorted(contract_pod.RESERVED_ENV))
def test_a_reserved_env_name_is_refused(settings, variable):
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(
            document("demo", **{settings: {"env": [{"name": variable, "value": "1"}]}})
        )
    assert f"spec.{settings}.env" in str(caught.value) and variable in str(caught.value)


def test_reserved_is_every_env_name_of_the_contract_and_every_one_the_builders_set():
    spelled = {v for k, v in vars(contract_pod).items() if k.startswith("ENV_")}
    assert spelled == contract_pod.RESERVED_ENV
    run = parse_rolloutrun(document("demo"))
    for pod in (builders.trainer_pod(run, 1), builders.gym_pod(run, 1, 0)):
        assert {e["name"] for e in pod["spec"]["containers"][0]["env"]} <= spelled


def test_validate_command_reports_names_and_reserved_env(tmp_path):
    bad = tmp_path / "bad.yaml"
    doc = document("7b-grpo", trainer={"env": [{"name": naming.ENV_INCARNATION, "value": "9"}]})
    bad.write_text(yaml.safe_dump(doc))
    result = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "validate", str(bad)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "ROLLOUTRUN_INCARNATION" in result.stdout
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump(document("7b-grpo")))
    result = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "validate", str(named)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "DNS-1035 label" in result.stdout


# ----------------------------------------------------------------- failed passes
def test_a_refused_child_is_named_with_the_apis_message():
    error = KubeError("POST /api/v1/namespaces/x/pods: 403 ...", 403, "Forbidden", "exceeded quota")
    error.child = "Pod/demo-i1-gym-1"
    reason, message = describe_failure(error)
    assert reason == "ChildRejected"
    assert "Pod/demo-i1-gym-1" in message and "exceeded quota" in message and "403" in message


def test_other_failures_are_quoted():
    assert describe_failure(KubeError("GET x: timed out"))[0] == "ApiError"
    throttled = KubeError("POST x: 429", 429)
    throttled.child = "Pod/p"
    assert describe_failure(throttled)[0] == "ApiError"
    assert describe_failure(ValueError("boom")) == ("ReconcileError", "ValueError: boom")


def test_retries_back_off_to_a_bound():
    delays = [retry_delay(n) for n in range(1, 12)]
    assert delays[:3] == [5.0, 10.0, 20.0]
    assert delays == sorted(delays) and delays[-1] == MAX_RETRY_SECONDS


def test_a_failure_is_written_once_and_keeps_the_other_conditions():
    status = {
        "conditions": [
            {"type": "Ready", "status": "True", "reason": "Running", "lastTransitionTime": "t0"},
            {"type": "Failed", "status": "False", "reason": "Running", "lastTransitionTime": "t0"},
        ]
    }
    patch = failure_patch(status, "ChildRejected", "the API refused Pod/x", NOW)
    assert patch is not None
    by_type = {c["type"]: c for c in patch["conditions"]}
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == ("False", "ChildRejected")
    assert by_type["Failed"]["reason"] == "Running"
    assert failure_patch(patch, "ChildRejected", "the API refused Pod/x", NOW) is None
