"""The CRD's cross-field rules (CEL), the fields the operator owns, time formats, reasons.

The CEL rules are evaluated by cel-python (the ``test`` extra) against the generated CRD,
after the schema's defaulting, as the API server does at admission; the same documents go
through ``rolloutrun validate``'s parse, which must refuse them with the same message.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster import cel
from rolloutrun_localcluster.schema import apply_defaults
from rolloutrun_operator.api import crdgen
from rolloutrun_operator.api.v1alpha1 import (
    ARGS_NEED_COMMAND,
    GRACE_BELOW_TERMINATION,
    RESERVED_ENV_RULE,
    STANDBY_NEEDS_REPLICAS,
    STORAGE_NEEDS_CLAIM,
)
from rolloutrun_operator.api.validation import RolloutRunInvalid, parse_rolloutrun
from rolloutrun_operator.builders import render_run_config
from rolloutrun_operator.conditions import Desired
from rolloutrun_runtime.contract.field_rules import FieldRule
from rolloutrun_runtime.contract.policy_config import CHAT_TEMPLATE_NEEDS_MODEL
from rolloutrun_runtime.contract.run_config import (
    DATASET_NEEDS_EXTERNAL,
    HEADS_DIVIDE_WIDTH,
    OPERATOR_OWNED_FIELDS,
    TURN_NEEDS_MULTI_TURN,
    load_run_config,
)
from tests.support.rolloutruns import BASE

ROOT = Path(__file__).resolve().parents[3]
RULES = (
    HEADS_DIVIDE_WIDTH,
    TURN_NEEDS_MULTI_TURN,
    STORAGE_NEEDS_CLAIM,
    GRACE_BELOW_TERMINATION,
    RESERVED_ENV_RULE,
    DATASET_NEEDS_EXTERNAL,
    ARGS_NEED_COMMAND,
    CHAT_TEMPLATE_NEEDS_MODEL,
    STANDBY_NEEDS_REPLICAS,
)
needs_cel = pytest.mark.skipif(not cel.available(), reason="cel-python (test extra) missing")


def _schema() -> dict[str, Any]:
    return crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _document(**spec: Any) -> dict[str, Any]:
    document = copy.deepcopy(BASE)
    for key, value in spec.items():
        document["spec"][key] = {**document["spec"].get(key, {}), **value}
    return document


def admission_causes(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """What the API server's CEL rules refuse in ``document`` (after its defaulting)."""
    schema = _schema()
    return cel.rule_causes(apply_defaults(copy.deepcopy(document), schema), schema)


def _crd_rules(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, list):
        return [rule for item in node for rule in _crd_rules(item)]
    if not isinstance(node, dict):
        return []
    found = list(node.get("x-kubernetes-validations") or [])
    return found + [rule for value in node.values() for rule in _crd_rules(value)]


#: (rule, a spec breaking only it, the field the API server blames)
BAD_SPECS: list[tuple[FieldRule, dict[str, Any], str]] = [
    (HEADS_DIVIDE_WIDTH, {"run": {"policy": {"dModel": 66, "nHeads": 4}}}, "spec.run.policy"),
    (
        TURN_NEEDS_MULTI_TURN,
        {"run": {"checkpointing": {"targetLevel": "turn"}, "task": {"name": "arithmetic"}}},
        "spec.run",
    ),
    (
        STORAGE_NEEDS_CLAIM,
        {"storage": {"uri": "file:///tmp/rolloutrun/x", "volumeClaimName": None}},
        "spec.storage.volumeClaimName",
    ),
    (GRACE_BELOW_TERMINATION, {"trainer": {"terminationGracePeriodSeconds": 25}}, "spec"),
    (
        GRACE_BELOW_TERMINATION,
        {
            "trainer": {"terminationGracePeriodSeconds": 60},
            "run": {"checkpointing": {"preemptionGraceSeconds": 60}},
        },
        "spec",
    ),
    (
        RESERVED_ENV_RULE,
        {"gym": {"env": [{"name": "ROLLOUTRUN_INCARNATION", "value": "9"}]}},
        "spec.gym.env",
    ),
    (
        DATASET_NEEDS_EXTERNAL,
        {"run": {"task": {"name": "arithmetic", "dataset": {"uri": "data/p.jsonl"}}}},
        "spec.run.task",
    ),
    (ARGS_NEED_COMMAND, {"gym": {"args": ["--port", "8000"]}}, "spec.gym"),
    (CHAT_TEMPLATE_NEEDS_MODEL, {"run": {"policy": {"chatTemplate": True}}}, "spec.run.policy"),
    (STANDBY_NEEDS_REPLICAS, {"workers": {"standby": 1}}, "spec.workers.standby"),
]


def _bad(spec: dict[str, Any]) -> dict[str, Any]:
    document = _document(**spec)
    storage = document["spec"]["storage"]
    document["spec"]["storage"] = {k: v for k, v in storage.items() if v is not None}
    return document


@needs_cel
@pytest.mark.parametrize(("rule", "spec", "field"), BAD_SPECS)
def test_a_cel_rule_refuses_a_bad_spec_with_the_message_validate_gives(rule, spec, field):
    document = _bad(spec)
    causes = admission_causes(document)
    assert [(f, rule.message in m) for _, f, m in causes] == [(field, True)], causes
    # rolloutrun validate (and the operator's parse) refuse it with the same message
    with pytest.raises(RolloutRunInvalid) as refused:
        parse_rolloutrun(document)
    assert rule.message in str(refused.value)


@needs_cel
def test_the_api_server_wording_of_a_refusal():
    (cause,) = admission_causes(_bad(BAD_SPECS[0][1]))
    assert cause == (
        "FieldValueInvalid",
        "spec.run.policy",
        f'spec.run.policy: Invalid value: "object": {HEADS_DIVIDE_WIDTH.message}',
    )
    (cause,) = admission_causes(_bad(BAD_SPECS[2][1]))
    assert cause[0] == "FieldValueRequired"
    assert cause[2].startswith("spec.storage.volumeClaimName: Required value: required with")


@needs_cel
@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.yaml")), ids=str)
def test_good_specs_pass_every_rule(example):
    import yaml

    assert admission_causes(_document()) == []
    for document in yaml.safe_load_all(example.read_text()):
        assert admission_causes(document) == [], example
    # a gs:// run needs no claim; sparse specs (no trainer, no run) rely on the defaults
    sparse = {"apiVersion": BASE["apiVersion"], "kind": "RolloutRun", "metadata": {"name": "s"}}
    assert admission_causes({**sparse, "spec": {"storage": {"uri": "gs://bucket/p"}}}) == []


@needs_cel
def test_every_crd_rule_compiles_and_is_one_the_models_enforce():
    rules = _crd_rules(_schema())
    assert {entry["rule"] for entry in rules} == {rule.rule for rule in RULES}
    import celpy

    for entry in rules:
        assert entry["message"], entry
        celpy.Environment().compile(entry["rule"])  # a syntax error raises


def test_operator_owned_fields_are_not_in_the_schema_and_are_refused_clearly():
    run_schema = _schema()["properties"]["spec"]["properties"]["run"]["properties"]
    for dotted in OPERATOR_OWNED_FIELDS:
        section, _, key = dotted.partition(".")
        assert key not in run_schema[section]["properties"], dotted
        document = _document(run={section: {key: "x"}})
        with pytest.raises(RolloutRunInvalid) as refused:
            parse_rolloutrun(document)
        assert f"spec.run.{dotted}: set by the operator from" in str(refused.value)


def test_the_trainer_still_receives_the_owned_fields_filled_in():
    run = parse_rolloutrun(_document(gym={"replicas": 3}))
    config = render_run_config(run, ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://h:3"])
    assert config.gym.replicas == 3 and len(config.gym.endpoints) == 3
    assert config.checkpointing.storage_uri == BASE["spec"]["storage"]["uri"]


def test_a_rolloutrun_file_gives_rolloutrun_train_its_gym_replicas(tmp_path):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_document(gym={"replicas": 3})))
    assert load_run_config(path).gym.replicas == 3


def _status_times(node: Any, path: str = "status") -> dict[str, Any]:
    found = {}
    for key, child in (node.get("properties") or {}).items():
        where = f"{path}.{key}"
        if key.endswith(("Time", "At")) or key == "time":
            found[where] = child
        found.update(_status_times(child, where))
    if isinstance(node.get("items"), dict):
        found.update(_status_times(node["items"], f"{path}[]"))
    return found


def test_status_times_are_date_time_and_reasons_never_empty():
    status = _schema()["properties"]["status"]
    times = _status_times(status)
    # the Lease's renewTime is the trainer's string, compared for change only: left as is
    times.pop("status.lease.renewTime")
    assert len(times) >= 6 and all(t.get("format") == "date-time" for t in times.values()), times
    condition = status["properties"]["conditions"]["items"]
    assert "reason" in condition["required"] and condition["properties"]["reason"]["minLength"] == 1
    with pytest.raises(ValueError, match="reason must not be empty"):
        Desired(False, "")


@needs_cel
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_local_cluster_refuses_a_cel_violation_with_the_real_422(tmp_path):
    import yaml

    from rolloutrun_localcluster.testing import local_cluster

    with contextlib.contextmanager(local_cluster)(tmp_path / "cluster") as cluster:
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig_path)}

        def kubectl(*args: str, stdin: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["kubectl", *args], input=stdin, env=env, capture_output=True, text=True
            )

        crd = (ROOT / "crds" / "rolloutruns.rolloutrun.dev.yaml").read_text()
        assert kubectl("create", "-f", "-", stdin=crd).returncode == 0
        bad = _bad(BAD_SPECS[0][1])
        bad["metadata"] = {"name": "bad", "namespace": "default"}
        refused = kubectl("create", "-f", "-", stdin=yaml.safe_dump(bad))
        assert refused.returncode == 1
        assert refused.stderr.strip() == (
            'The RolloutRun "bad" is invalid: spec.run.policy: Invalid value: "object": '
            f"{HEADS_DIVIDE_WIDTH.message}"
        )
        good = _document()
        good["metadata"] = {"name": "good", "namespace": "default"}
        created = kubectl("create", "-f", "-", stdin=yaml.safe_dump(good))
        assert created.stdout == "rolloutrun.rolloutrun.dev/good created\n", created.stderr
