"""Validate RolloutRun documents the way the API server and the operator will.

Two layers, because neither alone is enough: the CRD's structural schema (what
``kubectl apply`` against a real API server enforces, with strict field validation rejecting
unknown fields) and the pydantic models (which also check what a schema cannot express, such
as the run name's length against the Gym replicas). The rules across fields that CEL can
express (``dModel`` divisible by ``nHeads``, ``file://`` storage with a claim, ...) are in the
CRD as ``x-kubernetes-validations`` and in the models' validators, with one message each.
``rolloutrun validate FILE`` runs both offline, so a user finds a typo before the cluster
does; errors name the field path.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rolloutrun_operator import builders, name_rules, pod_templates
from rolloutrun_operator.api import crdgen
from rolloutrun_operator.api.v1alpha1 import GROUP, KIND, STORAGE_NEEDS_CLAIM, VERSION, RolloutRun
from rolloutrun_runtime.contract.kube_yaml import YAMLError, load_yaml_all
from rolloutrun_runtime.contract.run_config import OPERATOR_OWNED_FIELDS


class RolloutRunInvalid(ValueError):
    """A RolloutRun document is invalid; ``problems`` lists ``path: message`` lines."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid RolloutRun\n  " + "\n  ".join(problems))


def strict_json_schema(node: Any) -> Any:
    """The CRD schema as plain JSON Schema: ``nullable`` as a null type, unknown fields denied."""
    if isinstance(node, list):
        return [strict_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: strict_json_schema(value)
        for key, value in node.items()
        if not key.startswith("x-kubernetes-") and key != "nullable"
    }
    for key in ("properties",):
        if key in node:
            out[key] = {name: strict_json_schema(child) for name, child in node[key].items()}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    if node.get("exclusiveMinimum") is True:
        out["exclusiveMinimum"] = out.pop("minimum")
    if node.get("exclusiveMaximum") is True:
        out["exclusiveMaximum"] = out.pop("maximum")
    return out


@functools.cache
def _crd_schema() -> dict[str, Any]:
    schema: dict[str, Any] = crdgen.build_crd()["spec"]["versions"][0]["schema"]
    return schema["openAPIV3Schema"]


@functools.cache
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft7Validator(strict_json_schema(copy.deepcopy(_crd_schema())))


def without_non_nullable_nulls(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` less its ``null`` fields the schema does not mark ``nullable``: the API
    server prunes them before defaulting (so ``key:`` left empty by a template means the
    default), and so must an offline check that claims to refuse what it refuses."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [without_non_nullable_nulls(item, schema["items"]) for item in value]
    if not isinstance(value, dict):
        return value
    properties = schema.get("properties") or {}
    additional = schema.get("additionalProperties")
    kept = {}
    for key, item in value.items():
        sub = properties.get(key, additional if isinstance(additional, dict) else None)
        if sub is None:
            kept[key] = item  # unknown: the schema check names it
        elif item is not None or sub.get("nullable"):
            kept[key] = without_non_nullable_nulls(item, sub)
    return kept


def schema_problems(document: dict[str, Any]) -> list[str]:
    """What the CRD schema rejects in ``document``, as ``path: message`` lines."""
    problems = []
    for error in sorted(_validator().iter_errors(document), key=lambda e: list(e.path)):
        path = ".".join(str(part) for part in error.absolute_path) or "(root)"
        message = schema_message(
            error.validator, error.validator_value, error.instance, error.message
        )
        problems.append(f"{path}: {message}")
    return problems


def schema_message(validator: Any, expected: Any, instance: Any, message: str) -> str:
    """A schema error's message with values as the file spells them (``true``, ``null``,
    ``"1e3"``), not as Python does (``True``, ``None``, ``'1e3'``)."""
    if validator == "type":
        kinds = expected if isinstance(expected, list) else [expected]
        return f"{json.dumps(instance)} is not of type {' or '.join(kinds)}"
    if validator == "enum":
        return f"{json.dumps(instance)} is not one of {', '.join(json.dumps(v) for v in expected)}"
    if isinstance(instance, str | int | float | bool) or instance is None:
        shown = repr(instance)
        if message.startswith(shown):
            return json.dumps(instance) + message[len(shown) :]
    return message


def parse_rolloutrun(document: Any, source: str = "RolloutRun") -> RolloutRun:
    """Validate a RolloutRun mapping against the CRD schema and the models."""
    if not isinstance(document, dict):
        raise RolloutRunInvalid(source, ["(root): expected a mapping"])
    expected = f"{GROUP}/{VERSION}"
    header = []
    if document.get("apiVersion") != expected:
        header.append(f"apiVersion: expected {expected!r}, got {document.get('apiVersion')!r}")
    if document.get("kind") != KIND:
        header.append(f"kind: expected {KIND!r}, got {document.get('kind')!r}")
    document = without_non_nullable_nulls(document, _crd_schema())
    problems = header + operator_owned_problems(document) + schema_problems(document)
    if problems:
        raise RolloutRunInvalid(source, problems)
    try:
        run = RolloutRun.model_validate(document)
    except ValidationError as error:
        raise RolloutRunInvalid(
            source,
            [
                f"{'.'.join(str(p) for p in item['loc']) or '(root)'}: {_message(item['msg'])}"
                for item in error.errors()
            ],
        ) from error
    problems = name_problems(run) + storage_claim_problems(run) + template_problems(run)
    if problems:
        raise RolloutRunInvalid(source, problems)
    return run


def _message(text: str) -> str:
    """A model's own check without pydantic's "Value error, " in front of what it says."""
    return text.removeprefix("Value error, ")


def storage_claim_problems(run: RolloutRun) -> list[str]:
    """A ``file://`` storage path needs a claim: without a volume the path lies in each
    pod's own filesystem (read-only, or dying with the pod), so the first preemption loses
    every checkpoint and Gym audit record. Refused, not warned: it cannot work on a cluster."""
    storage = run.spec.storage
    if storage.uri.startswith("gs://") or storage.volume_claim_name is not None:
        return []
    return [f"spec.storage.volumeClaimName: {STORAGE_NEEDS_CLAIM.message} (uri {storage.uri!r})"]


def operator_owned_problems(document: dict[str, Any]) -> list[str]:
    """``spec.run`` fields the operator derives, set by the user: said plainly (the schema
    alone would only call them unknown). A real API server prunes them, or refuses them as
    unknown fields under strict field validation (kubectl's default)."""
    spec = document.get("spec")
    run = spec.get("run") if isinstance(spec, dict) else None
    problems = []
    for dotted, source in OPERATOR_OWNED_FIELDS.items():
        section, _, key = dotted.partition(".")
        block = run.get(section) if isinstance(run, dict) else None
        if isinstance(block, dict) and key in block:
            problems.append(
                f"spec.run.{dotted}: set by the operator from {source}, not in spec.run; remove it"
            )
    return problems


def template_problems(run: RolloutRun) -> list[str]:
    """What the pod templates (``spec.trainer.template``, ``spec.gym.template``) would
    override of the operator's member pods, found by merging them into the pods the
    operator builds (:mod:`~rolloutrun_operator.pod_templates`), as ``path: why`` lines.
    The fields the operator always sets are refused before, by the models."""
    templates = (run.spec.trainer.template, run.spec.gym.template, run.spec.workers.template)
    if all(template is None for template in templates):
        return []
    from rolloutrun_operator.worker_pods import worker_pod

    named = run.model_copy(update={"metadata": {"name": "run", **run.metadata}})
    problems: list[str] = []
    for build in (
        lambda: builders.trainer_pod(named, 0),
        lambda: builders.gym_pod(named, 0, 0),
        lambda: worker_pod(named, 0, 0, 0, "10.0.0.1") if run.spec.workers.replicas else {},
    ):
        try:
            build()
        except pod_templates.TemplateConflict as conflict:
            problems += conflict.problems
    return problems


def name_problems(run: RolloutRun) -> list[str]:
    """What the API server would refuse in the names and mount paths the operator derives
    from ``run`` (:mod:`~rolloutrun_operator.name_rules`), as ``path: message`` lines. A
    document without ``metadata.name`` (``generateName``, a template) has its names
    checked once it is named."""
    problems = []
    name = run.metadata.get("name")
    if isinstance(name, str):
        problems += [
            f"metadata.name: {line}"
            for line in name_rules.run_name_problems(name, run.spec.gym.pods)
        ]
    storage = run.spec.storage
    if storage.volume_claim_name is not None and not storage.uri.startswith("gs://"):
        path = storage.uri.removeprefix("file://")
        mount = name_rules.storage_mount_problem(path)
        if mount is not None:
            problems.append(f"spec.storage.uri: {mount}")
    return problems


def load_rolloutruns(path: Path) -> list[RolloutRun]:
    """Every RolloutRun document in a YAML file, validated; a file with none is invalid."""
    try:
        documents = [doc for doc in load_yaml_all(path.read_text()) if doc is not None]
    except YAMLError as error:
        raise RolloutRunInvalid(str(path), [f"(root): not valid YAML: {error}"]) from error
    if not documents:  # as `kubectl apply` refuses it: "no objects passed to apply"
        raise RolloutRunInvalid(str(path), ["(root): no document in the file"])
    return [
        parse_rolloutrun(doc, f"{path}[{index}]" if len(documents) > 1 else str(path))
        for index, doc in enumerate(documents)
    ]


def _run_validate(args: argparse.Namespace) -> int:
    failed = 0
    for name in args.files:
        try:
            runs = load_rolloutruns(Path(name))
        except (OSError, RolloutRunInvalid) as error:
            failed += 1
            print(error)
            continue
        for run in runs:
            print(f"{name}: RolloutRun {run.metadata.get('name', '?')!r} is valid")
    return 1 if failed else 0


def register_cli(parser: argparse.ArgumentParser) -> None:
    """Validate RolloutRun YAML files offline (CRD schema and model checks)."""
    parser.add_argument("files", nargs="+", help="RolloutRun YAML files")
    parser.set_defaults(handler=_run_validate)
