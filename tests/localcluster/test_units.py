"""The pure decisions of the local cluster, as tables: selectors, patches, schema messages,
watch transitions, garbage-collection plans, endpoints, env expansion, pod phases."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from rolloutrun_localcluster import gc, patches, podspec, schema, selectors
from rolloutrun_localcluster.errors import ApiError
from rolloutrun_localcluster.store import transition


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("a=b", {"a": "b"}, True),
        ("a==b", {"a": "c"}, False),
        ("a!=b", {}, True),
        ("a in (x, y),b", {"a": "y", "b": ""}, True),
        ("a notin (x)", {"a": "x"}, False),
        ("!a", {"a": "1"}, False),
        ("app.kubernetes.io/name=web,tier", {"app.kubernetes.io/name": "web", "tier": "1"}, True),
        ("", {"anything": "goes"}, True),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert selectors.labels_match(selectors.parse_label_selector(selector), labels) is matches


def test_bad_selectors_are_400() -> None:
    with pytest.raises(ApiError) as error:
        selectors.parse_label_selector("a in x")
    assert error.value.code == 400
    with pytest.raises(ApiError) as error:
        selectors.parse_field_selector("spec.nodeName=x", "configmaps")
    assert error.value.message == "field label not supported: spec.nodeName"
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "local"}, "status": {"phase": "Running"}}
    parsed = selectors.parse_field_selector("spec.nodeName=local,status.phase!=Failed", "pods")
    assert selectors.fields_match(parsed, pod)


def test_label_selector_objects() -> None:
    spec = {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]}
    requirements = selectors.selector_from_label_selector(spec)
    assert requirements is not None
    assert selectors.labels_match(requirements, {"a": "1", "b": ""})
    assert not selectors.labels_match(requirements, {"a": "1"})
    assert selectors.selector_from_label_selector(None) is None


def test_merge_and_json_patch() -> None:
    assert patches.merge_patch({"a": {"b": 1, "c": 2}, "d": [1]}, {"a": {"b": None}, "d": [2]}) == {
        "a": {"c": 2},
        "d": [2],
    }
    doc = {"a": [1, 2], "b": {"c~d/e": 1}}
    ops = [
        {"op": "add", "path": "/a/-", "value": 3},
        {"op": "remove", "path": "/b/c~0d~1e"},
        {"op": "copy", "from": "/a/0", "path": "/first"},
        {"op": "move", "from": "/first", "path": "/b/moved"},
        {"op": "test", "path": "/a", "value": [1, 2, 3]},
    ]
    assert patches.json_patch(doc, ops) == {"a": [1, 2, 3], "b": {"moved": 1}}
    assert doc == {"a": [1, 2], "b": {"c~d/e": 1}}, "the input is not modified"
    for bad in ([{"op": "test", "path": "/a", "value": []}], [{"op": "remove", "path": "/zz"}]):
        with pytest.raises(ApiError) as error:
            patches.json_patch(doc, bad)
        assert error.value.code == 422


def test_strategic_merge_patch_directives() -> None:
    pod: dict[str, Any] = {
        "metadata": {"finalizers": ["a"], "labels": {"x": "1"}},
        "spec": {
            "containers": [
                {
                    "name": "c1",
                    "image": "i1",
                    "env": [{"name": "A", "value": "1"}],
                    "ports": [{"containerPort": 80}],
                },
                {"name": "c2", "image": "i2"},
            ],
            "tolerations": [{"key": "t1"}],
        },
    }
    patch = {
        "metadata": {"finalizers": ["b"], "labels": {"x": None}},
        "spec": {
            "$setElementOrder/containers": [{"name": "c1"}, {"name": "c2"}],
            "containers": [
                {
                    "name": "c1",
                    "env": [{"name": "B", "value": "2"}],
                    "ports": [{"containerPort": 81}],
                },
                {"name": "c2", "$patch": "delete"},
            ],
            "tolerations": [{"key": "t2"}],
        },
    }
    result = patches.strategic_merge_patch(pod, patch)
    assert result["metadata"] == {"finalizers": ["a", "b"], "labels": {}}
    (container,) = result["spec"]["containers"]
    assert container["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    assert container["ports"] == [{"containerPort": 80}, {"containerPort": 81}]
    assert result["spec"]["tolerations"] == [{"key": "t2"}], "lists without a merge key replace"
    replaced = patches.strategic_merge_patch(pod, {"spec": {"$patch": "replace", "containers": []}})
    assert replaced["spec"] == {"containers": []}
    dropped = patches.strategic_merge_patch(
        pod, {"metadata": {"$deleteFromPrimitiveList/finalizers": ["a"]}}
    )
    assert dropped["metadata"]["finalizers"] == []


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["n"],
            "properties": {
                "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": True, "maximum": 5},
                "name": {"type": "string", "maxLength": 3, "pattern": "^[a-z]+$"},
                "tags": {"type": "array", "maxItems": 1, "items": {"type": "string"}},
                "mode": {"type": "string", "default": "fast", "enum": ["fast", "slow"]},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "port": {"x-kubernetes-int-or-string": True},
                "maybe": {"type": "string", "nullable": True},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        }
    },
}


@pytest.mark.parametrize(
    ("spec", "messages"),
    [
        ({"n": 5}, ["spec.n: Invalid value: 5: spec.n in body should be less than 5"]),
        (
            {"n": -1},
            ["spec.n: Invalid value: -1: spec.n in body should be greater than or equal to 0"],
        ),
        (
            {"n": 1, "name": "abcd"},
            ["spec.name: Too long: may not be more than 3 bytes"],
        ),
        (
            {"n": 1, "name": "A"},
            ["spec.name: Invalid value: \"A\": spec.name in body should match '^[a-z]+$'"],
        ),
        (
            {"n": 1, "tags": ["a", "b"]},
            ["spec.tags: Too many: 2: must have at most 1 items"],
        ),
        (
            {"n": 1, "labels": {"a": 1}},
            [
                'spec.labels.a: Invalid value: "integer": '
                'spec.labels.a in body must be of type string: "integer"'
            ],
        ),
        (
            {"n": True},
            ['spec.n: Invalid value: "boolean": spec.n in body must be of type integer: "boolean"'],
        ),
        ({"n": 1, "port": "http", "maybe": None}, []),
        (
            {"n": 1, "port": 1.5},
            ['spec.port: Invalid value: "float": spec.port in body must be of type int-or-string'],
        ),
        ({}, ["spec.n: Required value"]),
    ],
)
def test_schema_validation_messages(spec: dict[str, Any], messages: list[str]) -> None:
    found = [message for _, _, message in schema.validate({"spec": spec}, SCHEMA)]
    assert found == messages


def test_schema_pruning_and_defaults() -> None:
    body = {
        "apiVersion": "x/v1",
        "kind": "K",
        "metadata": {"name": "n"},
        "spec": {"n": 1, "extra": 1, "free": {"any": {"thing": 1}}},
        "top": 1,
    }
    pruned, dropped = schema.prune(body, SCHEMA)
    assert dropped == ["spec.extra", "top"]
    assert pruned["metadata"] == {"name": "n"} and pruned["spec"]["free"] == {"any": {"thing": 1}}
    assert schema.apply_defaults(pruned, SCHEMA)["spec"]["mode"] == "fast"


@pytest.mark.parametrize(
    ("event", "old", "new", "seen"),
    [
        ("ADDED", False, True, "ADDED"),
        ("ADDED", False, False, None),
        ("MODIFIED", True, True, "MODIFIED"),
        ("MODIFIED", False, True, "ADDED"),
        ("MODIFIED", True, False, "DELETED"),
        ("MODIFIED", False, False, None),
        ("DELETED", True, True, "DELETED"),
    ],
)
def test_watch_transitions(event: str, old: bool, new: bool, seen: str | None) -> None:
    assert transition(event, old, new) == seen


def _obj(
    name: str,
    uid: str,
    owners: Sequence[str] = (),
    finalizers: Sequence[str] = (),
    deleting: bool = False,
    namespace: str = "ns",
) -> tuple[str, dict[str, Any]]:
    meta: dict[str, Any] = {"name": name, "uid": uid, "namespace": namespace}
    if owners:
        meta["ownerReferences"] = [
            {"uid": owner, "name": owner, "kind": "K", "apiVersion": "v1"} for owner in owners
        ]
    if finalizers:
        meta["finalizers"] = list(finalizers)
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return "configmaps", {"metadata": meta}


def verbs(objects: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, str]]:
    return sorted(
        (a.verb, a.target.name, a.policy if a.verb == "delete" else a.finalizer or a.owner_uid)
        for a in gc.plan(objects)
    )


def test_gc_plans() -> None:
    # Dangling owner: background delete. Some owners alive: drop only the dangling reference.
    assert verbs([_obj("c", "2", ["gone"])]) == [("delete", "c", "Background")]
    assert verbs([_obj("o", "1"), _obj("c", "2", ["1", "gone"])]) == [("unown", "c", "gone")]
    # Foreground owner: dependents deleted in the foreground; the owner waits for them.
    foreground = [
        _obj("o", "1", finalizers=["foregroundDeletion"], deleting=True),
        _obj("c", "2", ["1"]),
    ]
    assert verbs(foreground) == [("delete", "c", "Foreground")]
    assert verbs([foreground[0]]) == [("finalize", "o", "foregroundDeletion")]
    # Orphan: references dropped, then the finalizer.
    orphan = [_obj("o", "1", finalizers=["orphan"], deleting=True), _obj("c", "2", ["1"])]
    assert verbs(orphan) == [("finalize", "o", "orphan"), ("unown", "c", "1")]
    # A terminating namespace: everything in it deleted, then the namespace finalized.
    namespace = ("namespaces", {"metadata": {"name": "ns", "uid": "n", "deletionTimestamp": "x"}})
    assert verbs([namespace, _obj("c", "2")]) == [("delete", "c", "Background")]
    assert verbs([namespace]) == [("finalize-namespace", "ns", "")]


def test_endpoints_follow_ready_pods() -> None:
    service = {
        "metadata": {"name": "s", "namespace": "ns"},
        "spec": {
            "selector": {"app": "a"},
            "ports": [{"name": "http", "port": 80, "targetPort": "web"}],
        },
    }

    def pod(name: str, ip: str, ready: bool, app: str = "a") -> dict[str, Any]:
        return {
            "metadata": {"name": name, "namespace": "ns", "uid": name, "labels": {"app": app}},
            "spec": {
                "nodeName": "local",
                "containers": [{"ports": [{"name": "web", "containerPort": 8080}]}],
            },
            "status": {
                "podIP": ip,
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }

    endpoints = gc.endpoints_for(
        service,
        [
            pod("a", "127.0.0.3", True),
            pod("b", "127.0.0.2", False),
            pod("c", "127.0.0.4", True, "other"),
        ],
    )
    assert endpoints is not None
    (subset,) = endpoints["subsets"]
    assert [a["ip"] for a in subset["addresses"]] == ["127.0.0.3"]
    assert [a["ip"] for a in subset["notReadyAddresses"]] == ["127.0.0.2"]
    assert subset["ports"] == [{"port": 8080, "protocol": "TCP", "name": "http"}]
    assert gc.endpoints_for({"metadata": {"name": "s"}, "spec": {}}, []) is None


def test_env_expansion_and_restart_rules() -> None:
    env = {"A": "1"}
    assert podspec.expand("$(A)-$(B)-$$(A)-$$$(A)", env) == "1-$(B)-$(A)-$1"
    assert podspec.container_argv({"command": ["x", "$(A)"], "args": ["--a=$(A)"]}, env) == [
        "x",
        "1",
        "--a=1",
    ]
    assert [
        podspec.should_restart(p, c)
        for p, c in [("Always", 0), ("OnFailure", 0), ("OnFailure", 1), ("Never", 1)]
    ] == [True, False, True, False]
    assert podspec.exit_code_of(-9) == 137 and podspec.exit_code_of(3) == 3
    pod = {
        "metadata": {"name": "p", "namespace": "n", "labels": {"a": "b"}},
        "spec": {},
        "status": {"podIP": "127.0.0.9"},
    }
    assert podspec.downward_value(pod, "metadata.labels['a']") == "b"
    with pytest.raises(podspec.ConfigError):
        podspec.container_env(
            pod,
            {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
            lambda n, m: None,
            lambda n, m: None,
            {},
        )


def test_termination_messages_fall_back_to_the_end_of_a_failed_containers_log() -> None:
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    log = b"".join(b"line %d\n" % i for i in range(200))
    message = podspec.termination_message(fallback, 78, log)
    assert message.splitlines() == [f"line {i}" for i in range(120, 200)]  # the last 80 lines
    assert podspec.termination_message(fallback, 0, log) == ""  # only on failure
    assert podspec.termination_message({}, 1, log) == ""  # the default policy is File
    long = podspec.termination_message(fallback, 1, b"x" * 5000 + b"\nwhy\n")
    assert len(long) == 2048 and long.endswith("\nwhy\n")


def test_pod_phases() -> None:
    record = podspec.ContainerRecord
    running = record("a", state="running")
    done = record("a", state="terminated", exit_code=0)
    failed = record("a", state="terminated", exit_code=2)
    restarting = record("a", state="terminated", exit_code=2, will_restart=True)
    assert podspec.pod_phase([], [record("a")], "Never") == "Pending"
    assert podspec.pod_phase([], [running], "Never") == "Running"
    assert podspec.pod_phase([], [done], "Never") == "Succeeded"
    assert podspec.pod_phase([], [done, failed], "Never") == "Failed"
    assert podspec.pod_phase([], [restarting], "Always") == "Running"
    assert podspec.pod_phase([failed], [record("a")], "Never") == "Failed"
    assert podspec.pod_phase([restarting], [record("a")], "Always") == "Pending"


def test_scheduler_chooses_a_fitting_least_loaded_node() -> None:
    from rolloutrun_localcluster.scheduler import choose_node

    def node(
        name: str, ready: bool = True, taints: Sequence[dict[str, str]] = ()
    ) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": {"taints": list(taints)},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "Unknown"}]},
        }

    unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    nodes = [node("a"), node("b"), node("c", ready=False, taints=[unreachable])]
    pod: dict[str, Any] = {"spec": {}}
    assert choose_node(pod, nodes, {"a": 2, "b": 1}) == ("b", "")
    assert (
        choose_node({"spec": {"nodeSelector": {"kubernetes.io/hostname": "a"}}}, nodes, {"a": 5})[0]
        == "a"
    )
    chosen, message = choose_node(
        {"spec": {"nodeSelector": {"kubernetes.io/hostname": "c"}}}, nodes, {}
    )
    assert chosen is None
    assert message == (
        "0/3 nodes are available: 2 node(s) didn't match Pod's node affinity/selector, "
        "1 node(s) were not ready."
    )
    tainted = [node("t", taints=[{"key": "gpu", "value": "yes", "effect": "NoSchedule"}])]
    assert choose_node(pod, tainted, {})[0] is None
    tolerant = {"spec": {"tolerations": [{"key": "gpu", "operator": "Equal", "value": "yes"}]}}
    assert choose_node(tolerant, tainted, {})[0] == "t"
    assert choose_node({"spec": {"tolerations": [{"operator": "Exists"}]}}, tainted, {})[0] == "t"


def test_updates_finish_a_deletion_only_without_finalizers_and_grace() -> None:
    from rolloutrun_localcluster.store import should_delete_during_update

    def meta(**fields: Any) -> dict[str, Any]:
        return {"metadata": {"name": "x", **fields}}

    deleting = {"deletionTimestamp": "2026-01-01T00:00:00Z"}
    assert should_delete_during_update(meta(**deleting, deletionGracePeriodSeconds=0))
    assert not should_delete_during_update(meta(**deleting, finalizers=["f"]))
    assert not should_delete_during_update(meta(**deleting, deletionGracePeriodSeconds=30))
    assert not should_delete_during_update(meta())


def test_a_null_where_the_schema_is_not_nullable_is_absent_defaulted_or_pruned() -> None:
    spec = {"n": 1, "mode": None, "name": None, "maybe": None, "labels": {"a": None}}
    defaulted = schema.apply_defaults({"spec": spec}, SCHEMA)
    assert defaulted["spec"] == {"n": 1, "mode": "fast", "maybe": None, "labels": {}}
    assert schema.validate(defaulted, SCHEMA) == []
    required = schema.apply_defaults({"spec": {"n": None}}, SCHEMA)
    assert [m for _, _, m in schema.validate(required, SCHEMA)] == ["spec.n: Required value"]


def test_a_pod_deleted_before_it_started_turns_failed_and_keeps_foreign_conditions() -> None:
    from rolloutrun_localcluster import podspec

    now = "2026-01-01T00:00:00Z"
    pending = {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"},
            {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},
        ],
    }
    failed = podspec.deleted_before_start(pending, now)
    assert failed is not None and failed["phase"] == "Failed"
    by_type = {c["type"]: c for c in failed["conditions"]}
    assert by_type["PodScheduled"]["lastTransitionTime"] == "t0"  # unchanged: kept
    assert (by_type["Ready"]["status"], by_type["Ready"]["reason"]) == ("False", "PodCompleted")
    assert by_type["Initialized"]["status"] == "False"
    assert by_type["DisruptionTarget"]["reason"] == "EvictionByEvictionAPI"
    assert podspec.deleted_before_start({"phase": "Succeeded"}, now) is None
    assert podspec.deleted_before_start(failed, now) is None
