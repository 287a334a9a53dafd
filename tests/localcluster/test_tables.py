"""The server-side Table as pure functions: ages as kubectl words them, typed CRD cells,
Events' columns, and what ``includeObject`` puts in each row."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from rolloutrun_localcluster.errors import ApiError
from rolloutrun_localcluster.resources import BUILTINS, ResourceType
from rolloutrun_localcluster.table_printers import format_selector, human_duration
from rolloutrun_localcluster.tables import as_table, json_cell


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "<invalid>"),
        (-1, "0s"),
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (5 * 60 + 3, "5m3s"),
        (12 * 60 + 3, "12m"),
        (3 * 3600 + 4 * 60, "3h4m"),
        (5 * 3600, "5h"),
        (30 * 3600, "30h"),
        (2 * 86400 + 5 * 3600, "2d5h"),
        (30 * 86400, "30d"),
        (3 * 365 * 86400, "3y"),
        (3 * 365 * 86400 + 10 * 86400, "3y10d"),
        (9 * 365 * 86400 + 10 * 86400, "9y"),
    ],
)
def test_human_duration(seconds: int, text: str) -> None:
    assert human_duration(seconds) == text


@pytest.mark.parametrize(
    ("column_type", "value", "cell"),
    [
        ("integer", 3, 3),
        ("integer", 3.7, 3),
        ("integer", "3", None),
        ("integer", True, None),
        ("number", 1.5, 1.5),
        ("boolean", False, False),
        ("boolean", "false", None),
        ("string", "Running", "Running"),
        ("string", 7, "7"),
        ("string", {"a": 1}, '{"a":1}'),
        ("date", None, None),
        ("date", "yesterday", None),
        ("unknown", "x", None),
    ],
)
def test_json_cell(column_type: str, value: Any, cell: Any) -> None:
    assert json_cell(column_type, value) == cell


def test_format_selector() -> None:
    selector = {
        "matchLabels": {"b": "2", "a": "1"},
        "matchExpressions": [
            {"key": "tier", "operator": "In", "values": ["x", "y"]},
            {"key": "gone", "operator": "DoesNotExist"},
        ],
    }
    assert format_selector(selector) == "a=1,b=2,tier in (x,y),!gone"
    assert format_selector({}) == "<none>"


def builtin(plural: str) -> ResourceType:
    return next(t for t in BUILTINS if t.plural == plural)


def test_events_print_last_seen_type_reason_object_message_and_a_wide_name() -> None:
    now = datetime.now(UTC)
    event = {
        "metadata": {"name": "run.17", "namespace": "ns"},
        "involvedObject": {"kind": "RolloutRun", "name": "run", "fieldPath": "spec.trainer"},
        "reason": "Preempted",
        "message": "the trainer pod was evicted\n",
        "type": "Warning",
        "source": {"component": "rolloutrun-operator"},
        "reportingInstance": "operator-0",
        "eventTime": (now - timedelta(minutes=20)).strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
        "series": {"count": 4, "lastObservedTime": (now - timedelta(minutes=15)).isoformat()},
    }
    table = as_table(builtin("events"), [event], {})
    names = [(c["name"], c["priority"]) for c in table["columnDefinitions"]]
    assert [n for n, p in names if p == 0] == ["Last Seen", "Type", "Reason", "Object", "Message"]
    assert names[-1] == ("Name", 1)
    assert table["rows"][0]["cells"] == [
        "15m",
        "Warning",
        "Preempted",
        "rolloutrun/run",
        "spec.trainer",
        "rolloutrun-operator, operator-0",
        "the trainer pod was evicted",
        "20m",
        4,
        "run.17",
    ]


def test_include_object_says_what_a_row_carries() -> None:
    config_map = {"metadata": {"name": "c", "namespace": "ns"}, "data": {"a": "b"}}
    rtype = builtin("configmaps")
    default = as_table(rtype, [config_map], {})["rows"][0]
    assert default["object"] == {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": config_map["metadata"],
    }
    assert default["cells"][:2] == ["c", 1]
    assert as_table(rtype, [config_map], {}, "Object")["rows"][0]["object"] == config_map
    assert as_table(rtype, [config_map], {}, "None")["rows"][0]["object"] is None
    with pytest.raises(ApiError, match='Unsupported value: "Everything"'):
        as_table(rtype, [config_map], {}, "Everything")


def test_a_custom_resource_prints_its_columns_by_jsonpath_and_age_only_when_it_has_none() -> None:
    columns = (
        {
            "name": "Ready",
            "type": "string",
            "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        },
        {"name": "Step", "type": "integer", "jsonPath": ".status.trainStep", "priority": 1},
    )
    run = {
        "metadata": {"name": "r", "creationTimestamp": "2000-01-01T00:00:00Z"},
        "status": {"trainStep": 4, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    rtype = ResourceType("x.dev", "v1", "runs", "Run", True, custom=True, printer_columns=columns)
    table = as_table(rtype, [run, {"metadata": {"name": "bare"}}], {})
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Ready", "Step"]
    assert [row["cells"] for row in table["rows"]] == [["r", "True", 4], ["bare", None, None]]
    plain = ResourceType("x.dev", "v1", "plains", "Plain", True, custom=True)
    [row] = as_table(plain, [run], {})["rows"]
    assert row["cells"][0] == "r" and re.fullmatch(r"\d\dy", row["cells"][1])


def test_deployments_print_ready_up_to_date_available_and_wide_their_containers() -> None:
    deployment = {
        "metadata": {"name": "op", "namespace": "ns"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "op"}},
            "template": {"spec": {"containers": [{"name": "operator", "image": "r/op:1"}]}},
        },
        "status": {"readyReplicas": 1, "updatedReplicas": 2},
    }
    table = as_table(builtin("deployments"), [deployment], {})
    names = [(c["name"], c["priority"]) for c in table["columnDefinitions"]]
    assert [n for n, p in names if p == 0] == ["Name", "Ready", "Up-to-date", "Available", "Age"]
    cells = table["rows"][0]["cells"]
    assert cells[:4] == ["op", "1/2", 2, 0]
    assert cells[5:] == ["operator", "r/op:1", "app=op"]
    stored = {"metadata": {"name": "op"}, "spec": {}}  # stored, never run: no status
    assert as_table(builtin("deployments"), [stored], {})["rows"][0]["cells"][1:4] == ["0/1", 0, 0]
