"""The generated CRD: in sync with the models, structural, documented and bounded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from rolloutrun_operator.api import crdgen

ROOT = Path(__file__).resolve().parents[3]
CHECKED_IN = ROOT / "crds" / "rolloutruns.rolloutrun.dev.yaml"


def test_checked_in_crd_matches_the_models():
    assert CHECKED_IN.read_text() == crdgen.render_crd(), (
        "crds/rolloutruns.rolloutrun.dev.yaml is stale: run `make manifests`"
    )


def test_chart_copy_matches_when_the_chart_exists():
    chart_copy = ROOT / "charts" / "rolloutrun-operator" / "crds" / CHECKED_IN.name
    if chart_copy.exists():
        assert chart_copy.read_text() == CHECKED_IN.read_text(), "run `make manifests`"


def test_cli_prints_the_crd():
    out = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "crd"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == CHECKED_IN.read_text()


def _walk(node, path="spec"):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _schema():
    crd = yaml.safe_load(CHECKED_IN.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


FORBIDDEN_KEYS = {"$ref", "$defs", "anyOf", "allOf", "oneOf", "title", "const"}


def test_schema_is_structural():
    for path, node in _walk(_schema()):
        assert not FORBIDDEN_KEYS & node.keys(), f"{path} uses {FORBIDDEN_KEYS & node.keys()}"
        if path not in {"spec.metadata"}:
            assert "type" in node, f"{path} has no type"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def unbounded(node) -> str | None:
    kind = node.get("type")
    if kind in {"integer", "number"} and not {"minimum", "maximum"} <= node.keys():
        return "a number needs minimum and maximum"
    if kind == "string" and "enum" not in node and "maxLength" not in node:
        return "a string needs maxLength or enum"
    if kind == "array" and "maxItems" not in node:
        return "an array needs maxItems"
    if kind == "object" and "properties" not in node and "maxProperties" not in node:
        return "a map needs maxProperties"
    return None


def test_every_spec_and_status_property_is_documented_and_bounded():
    schema = _schema()
    problems = []
    for root in ("spec", "status"):
        for path, node in _walk(schema["properties"][root], root):
            if path.endswith("{}") or path.endswith("[]"):
                reason = unbounded(node)  # map values and list items: bounds only
            else:
                reason = None if node.get("description") else "no description"
                reason = reason or unbounded(node)
            if reason:
                problems.append(f"{path}: {reason}")
    assert problems == []


def test_the_completeness_check_can_fail():
    assert unbounded({"type": "integer", "minimum": 0}) is not None
    assert unbounded({"type": "string"}) is not None
    assert unbounded({"type": "array", "items": {}}) is not None
    assert unbounded({"type": "object"}) is not None


def test_crd_names_and_columns():
    crd = yaml.safe_load(CHECKED_IN.read_text())
    assert crd["metadata"]["name"] == "rolloutruns.rolloutrun.dev"
    assert crd["spec"]["names"]["shortNames"] == ["rr"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = [column["name"] for column in version["additionalPrinterColumns"]]
    assert columns[:5] == ["Step", "Reward", "Restarts", "Snapshot-Age", "Ready"]
    assert "Steps/min" in columns


def test_a_run_is_named_after_its_metadata_once_the_api_server_defaulted_it():
    """The CRD defaulted ``spec.run.name`` to the runtime's ``run``, so the API server wrote
    it into every RolloutRun and the operator's "metadata.name unless set" never applied:
    every run's manifests and storage anchor said ``run``, and one run resumed another's
    storage unrefused. Defaulted as the local cluster's API server does (structural
    defaulting from this CRD), the run keeps its own name; a name the user sets stays."""
    from rolloutrun_localcluster.schema import apply_defaults
    from rolloutrun_operator.api.v1alpha1 import RolloutRun
    from rolloutrun_operator.builders import render_run_config

    schema = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    document = yaml.safe_load((ROOT / "examples" / "tiny-grpo.yaml").read_text())
    document["metadata"]["namespace"] = "default"
    stored = apply_defaults(document, schema)
    assert "name" not in stored["spec"]["run"]
    assert render_run_config(RolloutRun.model_validate(stored)).name == "tiny-grpo"
    stored["spec"]["run"]["name"] = "chosen"
    assert render_run_config(RolloutRun.model_validate(stored)).name == "chosen"
