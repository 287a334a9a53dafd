"""Every example is a valid RolloutRun; malformed ones are rejected naming the field."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rolloutrun_operator.api.validation import (
    RolloutRunInvalid,
    load_rolloutruns,
    parse_rolloutrun,
)
from rolloutrun_runtime.contract.run_config import ConfigError, load_run_config

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(
    (ROOT / "examples").glob("envs/*/*.yaml")  # with their own environment servers
)


def test_there_are_examples_for_both_task_shapes():
    names = {path.name for path in EXAMPLES}
    assert {"tiny-grpo.yaml", "tiny-multiturn.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_a_valid_rolloutrun(path):
    (run,) = load_rolloutruns(path)
    config = load_run_config(path)
    assert config.name == run.metadata["name"]
    assert run.spec.run.task == config.task


def _example() -> dict:
    return yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())


def _set(document: dict, dotted: str, value) -> dict:
    document = copy.deepcopy(document)
    *parents, last = dotted.split(".")
    node = document
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return document


MALFORMED = [
    ("wrong type", "spec.run.grpo.groupSize", "eight", "spec.run.grpo.groupSize"),
    ("negative count", "spec.gym.replicas", -1, "spec.gym.replicas"),
    ("unknown field", "spec.run.grpo.groupSzie", 8, "spec.run.grpo"),
    ("bad storage URI", "spec.storage.uri", "s3://bucket/x", "spec.storage.uri"),
    ("bad enum", "spec.run.checkpointing.targetLevel", "everything", "targetLevel"),
    ("zero steps", "spec.run.grpo.maxSteps", 0, "spec.run.grpo.maxSteps"),
]


@pytest.mark.parametrize(
    ("case", "field", "value", "named"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_rolloutrun_is_rejected_naming_the_field(case, field, value, named):
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(_set(_example(), field, value), "example")
    assert named in str(caught.value), str(caught.value)


def test_cross_field_rule_the_schema_cannot_express_is_caught_by_the_models():
    document = _set(_example(), "spec.run.policy.nHeads", 3)
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(document, "example")
    assert "nHeads" in str(caught.value)


def test_turn_level_recovery_needs_a_multi_turn_task(tmp_path):
    document = _set(_example(), "spec.run.checkpointing.targetLevel", "turn")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError, match="targetLevel 'turn' needs a multi-turn task"):
        load_run_config(path)


def test_missing_required_storage_is_named():
    document = _example()
    del document["spec"]["storage"]
    with pytest.raises(RolloutRunInvalid, match="storage"):
        parse_rolloutrun(document)


def test_wrong_kind_is_named():
    with pytest.raises(RolloutRunInvalid, match="kind: expected 'RolloutRun'"):
        parse_rolloutrun({**_example(), "kind": "Pod"})


def test_validate_command_reports_and_exits_nonzero(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_set(_example(), "spec.gym.replicas", -1)))
    good = ROOT / "examples" / "tiny-grpo.yaml"
    result = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "validate", str(good), str(bad)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "tiny-grpo' is valid" in result.stdout
    assert "spec.gym.replicas" in result.stdout


@pytest.mark.parametrize("text", ["", "---\n---\n", "# only a comment\n"])
def test_a_file_without_a_document_is_invalid_not_silently_valid(tmp_path, text):
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(RolloutRunInvalid, match=r"\(root\): no document in the file"):
        load_rolloutruns(empty)
    result = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "validate", str(empty)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert f"{empty}: invalid RolloutRun" in result.stdout


def test_a_null_the_schema_does_not_allow_is_absent_as_the_api_server_prunes_it():
    nulls = _set(_set(_example(), "spec.recovery.maxRestarts", None), "spec.trainer", None)
    absent = _example()
    del absent["spec"]["recovery"]["maxRestarts"]
    assert parse_rolloutrun(nulls).spec == parse_rolloutrun(absent).spec
    with pytest.raises(RolloutRunInvalid, match=r"\(root\): 'spec' is a required property"):
        parse_rolloutrun({**_example(), "spec": None})


def test_numbers_read_as_kubectl_sends_them(tmp_path):
    """``maxSteps: 1e3`` is 1000 on a real cluster (Go's YAML, then JSON): valid offline too,
    and the trainer's config reads it alike; a fraction is still no integer."""
    text = (ROOT / "examples" / "tiny-grpo.yaml").read_text()
    assert "maxSteps: 30\n" in text
    for spelled, steps in [("1e3", 1000), ("1.0e3", 1000), ("30.0", 30)]:
        path = tmp_path / f"steps-{spelled}.yaml"
        path.write_text(text.replace("maxSteps: 30\n", f"maxSteps: {spelled}\n"))
        (run,) = load_rolloutruns(path)
        assert run.spec.run.grpo.max_steps == steps
        assert load_run_config(path).grpo.max_steps == steps
    fraction = tmp_path / "fraction.yaml"
    fraction.write_text(text.replace("maxSteps: 30\n", "maxSteps: 3.05e1\n"))
    with pytest.raises(RolloutRunInvalid, match=r"maxSteps: 30.5 is not of type integer"):
        load_rolloutruns(fraction)


@pytest.mark.parametrize(
    ("field", "value", "spelled"),
    [
        ("spec.run.grpo.maxSteps", True, "true"),
        ("spec.run.grpo.maxSteps", "30", '"30"'),
        ("spec.gym.command", ["python", None], "null"),  # a list item is not pruned
    ],
)
def test_a_wrong_value_is_named_as_the_file_spells_it(field, value, spelled):
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(_set(_example(), field, value), "example")
    assert f": {spelled} is not of type" in str(caught.value), str(caught.value)


def test_an_unsupported_value_is_named_with_the_supported_ones_as_the_file_spells_them():
    document = _set(_example(), "spec.run.checkpointing.targetLevel", "everything")
    with pytest.raises(RolloutRunInvalid) as caught:
        parse_rolloutrun(document, "example")
    assert (
        'spec.run.checkpointing.targetLevel: "everything" is not one of "none", "prompt_group"'
        in str(caught.value)
    ), str(caught.value)
