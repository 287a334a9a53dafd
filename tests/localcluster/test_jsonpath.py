"""The printer-column JSONPath subset, evaluated as client-go's jsonpath does (missing keys
give no result, the first result is the cell)."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutrun_localcluster.jsonpath import JsonPathError, find, first

RUN: dict[str, Any] = {
    "metadata": {"name": "r", "labels": {"app.kubernetes.io/name": "x"}},
    "spec": {"ports": [{"name": "a", "port": 80}, {"name": "b", "port": 443}]},
    "status": {
        "trainStep": 7,
        "ready": True,
        "conditions": [
            {"type": "Progressing", "status": "True", "reason": "Training"},
            {"type": "Ready", "status": "False", "reason": "StartingGyms"},
        ],
    },
}


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (".status.trainStep", [7]),
        ("{.status.trainStep}", [7]),
        ("status.trainStep", [7]),
        ('.status.conditions[?(@.type=="Ready")].status', ["False"]),
        ('.status.conditions[?(@.type=="Ready")].reason', ["StartingGyms"]),
        (".status.conditions[?(@.type=='Progressing')].reason", ["Training"]),
        ('.status.conditions[?(@.type!="Ready")].type', ["Progressing"]),
        (".status.conditions[?(@.reason)].type", ["Progressing", "Ready"]),
        ('.status.conditions[?(@.type=="Missing")].status', []),
        (".spec.ports[?(@.port>100)].name", ["b"]),
        (".spec.ports[?(@.port==80)].name", ["a"]),
        (".spec.ports[?(@.port<=80.0)].name", ["a"]),
        (".spec.ports[?(@.name>1)].name", []),
        (".spec.ports[0].port", [80]),
        (".spec.ports[-1].port", [443]),
        (".spec.ports[5].port", []),
        (".spec.ports[*].port", [80, 443]),
        (".spec.ports[0:1].name", ["a"]),
        (".spec.ports[1:].name", ["b"]),
        (".spec.ports.*.name", ["a", "b"]),
        (".spec.ports[*].*", ["a", 80, "b", 443]),
        ("..port", [80, 443]),
        (".metadata.labels['app.kubernetes.io/name']", ["x"]),
        (".status.missing.deeper", []),
        (".status.trainStep.deeper", []),
        ('.status.conditions[?(@.status=="True")].type', ["Progressing"]),
        (".status.conditions[?(@.status==true)].type", []),
    ],
)
def test_find(path: str, expected: list[Any]) -> None:
    assert find(RUN, path) == expected


def test_first_is_the_cell_and_none_when_missing() -> None:
    assert first(RUN, '.status.conditions[?(@.type=="Ready")].status') == "False"
    assert first(RUN, '.status.conditions[?(@.type=="Gone")].status') is None
    assert first({}, ".status.conditions[0]") is None


@pytest.mark.parametrize(
    ("path", "text"),
    [
        (".a[", "unclosed ["),
        (".a[x]", "unsupported subscript [x]"),
        (".a[?(@.b=~/x/)]", "unsupported"),
        (".a[?(@.b==nope)]", "unsupported literal 'nope'"),
        (".a b", "unexpected ' '"),
    ],
)
def test_a_path_outside_the_subset_is_refused_naming_it(path: str, text: str) -> None:
    with pytest.raises(JsonPathError, match=r".*") as caught:
        find(RUN, path)
    assert text in str(caught.value), str(caught.value)
