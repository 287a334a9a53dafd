"""Names, labels, annotations, selectors and container fields refused as the real API server
refuses them, with its texts; and the operator's early name checks agreeing with them."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from kubernetes import client as k8s

from rolloutrun_localcluster import validation
from rolloutrun_operator import builders, kube_names, name_rules
from tests.support.rolloutruns import BASE

DNS1035 = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
    "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or "
    "'my_value',  or '12345', regex used for validation is "
    "'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


def _refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(k8s.ApiException) as error:
        call()
    body: dict[str, Any] = json.loads(error.value.body or "{}")
    assert error.value.status == body["code"]
    return body


def test_a_service_named_7b_grpo_trainer_is_refused_with_the_real_text(
    client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    service = {"metadata": {"name": "7b-grpo-trainer"}, "spec": {"ports": [{"port": 80}]}}
    body = _refusal(lambda: core.create_namespaced_service(namespace, service))
    assert body["code"] == 422 and body["reason"] == "Invalid"
    assert body["message"] == (
        f'Service "7b-grpo-trainer" is invalid: metadata.name: Invalid value: '
        f'"7b-grpo-trainer": {DNS1035}'
    )
    assert body["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": f'Invalid value: "7b-grpo-trainer": {DNS1035}',
            "field": "metadata.name",
        }
    ]
    # The same name is a fine DNS-1123 subdomain: a ConfigMap may have it.
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "7b-grpo-trainer"}})


def test_names_follow_their_kinds_rule(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    body = _refusal(lambda: core.create_namespace({"metadata": {"name": "team.a"}}))
    assert body["message"] == (
        'Namespace "team.a" is invalid: metadata.name: Invalid value: "team.a": '
        "must not contain dots"
    )
    body = _refusal(
        lambda: core.create_namespaced_secret(namespace, {"metadata": {"name": "a" * 254}})
    )
    assert body["details"]["causes"][0]["message"] == (
        f'Invalid value: "{"a" * 254}": must be no more than 253 characters'
    )
    body = _refusal(
        lambda: core.create_namespaced_config_map(namespace, {"metadata": {"generateName": "Bad-"}})
    )
    fields = [cause["field"] for cause in body["details"]["causes"]]
    assert fields == ["metadata.generateName", "metadata.name"]
    made = core.create_namespaced_config_map(namespace, {"metadata": {"generateName": "x" * 70}})
    assert len(made.metadata.name) == 63  # the base is cut to 58 + 5 random characters
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    role = {"metadata": {"name": "Team:Readers"}, "rules": []}
    assert rbac.create_namespaced_role(namespace, role).metadata.name == "Team:Readers"
    body = _refusal(
        lambda: rbac.create_namespaced_role(namespace, {"metadata": {"name": "a%b"}, "rules": []})
    )
    assert body["details"]["causes"][0]["message"] == "Invalid value: \"a%b\": may not contain '%'"


def test_labels_annotations_and_finalizers(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    labels = {"example.com/tier": "web frontend"}
    body = _refusal(
        lambda: core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "c", "labels": labels}}
        )
    )
    assert body["message"] == (
        f'ConfigMap "c" is invalid: metadata.labels: Invalid value: "web frontend": {LABEL_VALUE}'
    )
    labels = {"Example.com/" + "k" * 64: "v"}
    causes = _refusal(
        lambda: core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "c", "labels": labels}}
        )
    )["details"]["causes"]
    messages = [cause["message"] for cause in causes]
    assert messages[0].startswith('Invalid value: "Example.com/kkk')
    assert "prefix part a lowercase RFC 1123 subdomain" in messages[0]
    assert messages[1].endswith("name part must be no more than 63 characters")
    big = {"a": "x" * (256 * 1024)}
    body = _refusal(
        lambda: core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "c", "annotations": big}}
        )
    )
    assert body["details"]["causes"] == [
        {
            "reason": "FieldValueTooLong",
            "message": "Too long: may not be more than 262144 bytes",
            "field": "metadata.annotations",
        }
    ]
    just = {"a": "x" * (256 * 1024 - 1)}
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "c", "annotations": just}})
    # Updates are checked too.
    body = _refusal(
        lambda: core.patch_namespaced_config_map(
            "c", namespace, {"metadata": {"labels": {"a": "-x"}}}
        )
    )
    assert body["details"]["causes"][0]["field"] == "metadata.labels"


def test_selectors_in_specs_and_in_queries(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    service = {"metadata": {"name": "web"}, "spec": {"selector": {"app": "a b"}}}
    body = _refusal(lambda: core.create_namespaced_service(namespace, service))
    assert body["message"].startswith('Service "web" is invalid: spec.selector: Invalid value:')
    net: Any = k8s.NetworkingV1Api(client)
    policy = {
        "metadata": {"name": "p"},
        "spec": {
            "podSelector": {"matchExpressions": [{"key": "app", "operator": "Has"}]},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"run": "x/y"}}}]}],
        },
    }
    causes = _refusal(lambda: net.create_namespaced_network_policy(namespace, policy))["details"][
        "causes"
    ]
    assert [(c["field"], c["message"]) for c in causes] == [
        (
            "spec.podSelector.matchExpressions[0].operator",
            'Invalid value: "Has": not a valid selector operator',
        ),
        ("spec.ingress[0].from[0].podSelector.matchLabels", f'Invalid value: "x/y": {LABEL_VALUE}'),
    ]
    body = _refusal(lambda: core.list_namespaced_pod(namespace, label_selector="app=a$"))
    assert body["code"] == 400 and body["reason"] == "BadRequest"
    assert body["message"] == (
        f'unable to parse requirement: values[0][app]: Invalid value: "a$": {LABEL_VALUE}'
    )
    body = _refusal(lambda: core.list_namespaced_pod(namespace, label_selector="app=a b"))
    assert body["message"] == "found 'b', expected: ',' or 'end of string'"
    body = _refusal(lambda: core.list_namespaced_pod(namespace, label_selector="a b/c/d"))
    assert body["message"] == (
        "unable to parse requirement: found 'b/c/d', expected: in, notin, =, ==, !=, gt, lt"
    )
    assert core.list_namespaced_pod(namespace, label_selector="n>3,x notin ()").items == []


def test_container_names_port_names_and_env_names(client: Any, namespace: str) -> None:
    core: Any = k8s.CoreV1Api(client)
    container = {
        "name": "Trainer",
        "image": "python",
        "ports": [{"name": "http--api", "containerPort": 80}],
        "env": [{"name": "1RANK", "value": "0"}, {"name": "OK.name-1", "value": "1"}],
    }
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [container]}}
    causes = _refusal(lambda: core.create_namespaced_pod(namespace, pod))["details"]["causes"]
    assert [(c["field"], c["message"]) for c in causes] == [
        (
            "spec.containers[0].name",
            'Invalid value: "Trainer": ' + kube_names.is_dns1123_label("A")[0],
        ),
        (
            "spec.containers[0].ports[0].name",
            'Invalid value: "http--api": must not contain consecutive hyphens',
        ),
        (
            "spec.containers[0].env[0].name",
            'Invalid value: "1RANK": a valid environment variable name must consist of '
            "alphabetic characters, digits, '_', '-', or '.', and must not start with a digit "
            "(e.g. 'my.env-name',  or 'MY_ENV.NAME',  or 'MyEnvName1', regex used for "
            "validation is '[-._a-zA-Z][-._a-zA-Z0-9]*')",
        ),
    ]


@pytest.mark.parametrize(
    ("run", "server_refuses"),
    [
        ("demo", False),
        ("r2d2", False),
        ("a" * 48, False),
        ("7b-grpo", True),  # Service 7b-grpo-trainer: not a DNS-1035 label
        ("run.v2", True),  # Service run.v2-gym: dots
        ("Demo", True),
        ("a" * 64, True),  # the run label's value
        ("a" * 49, False),  # the server takes it; the operator refuses (pod hostnames)
    ],
)
def test_the_operator_refuses_up_front_every_name_the_api_server_would(
    run: str, server_refuses: bool
) -> None:
    """One fact, enforced in two places: a run name whose objects the API server would
    refuse, the operator refuses up front (InvalidSpec naming the rule) instead of
    retrying a 422 forever; a name it accepts gives objects the server accepts."""
    from rolloutrun_operator.api.v1alpha1 import RolloutRun
    from rolloutrun_operator.reconcile import static_children

    doc = copy.deepcopy(BASE)
    doc["metadata"]["name"] = run
    model = RolloutRun.model_validate(doc)  # past the schema, not past the name rules
    objects = [*static_children(model, token="t"), builders.config_map(model, {}, 1)]
    assert {obj["kind"] for obj in objects} >= {"Service", "Secret", "ConfigMap", "Role"}
    refused = [
        cause for obj in objects for cause in validation.object_causes(_storage_key(obj), obj, None)
    ]
    assert bool(refused) is server_refuses, refused
    operator_problems = name_rules.run_name_problems(run, 2)
    if refused:
        assert operator_problems, refused
    if not operator_problems:
        assert not refused


def _storage_key(obj: dict[str, Any]) -> str:
    group = obj["apiVersion"].rpartition("/")[0]
    plural = obj["kind"].lower() + "s"
    if plural == "policys" or obj["kind"] == "NetworkPolicy":
        plural = "networkpolicies"
    return f"{plural}.{group}" if group else plural


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("a in (b", "unable to parse requirement: found '', expected: ',' or ')'"),
        ("a=b,", "found '', expected: identifier after ','"),
        ("=x", "found '=', expected: !, identifier, or 'end of string'"),
        (
            "x>a",
            "unable to parse requirement: values[0]: Invalid value: \"a\": for 'Gt', 'Lt' "
            "operators, the value must be an integer",
        ),
        (
            "a/b/c",
            'unable to parse requirement: <nil>: Invalid value: "a/b/c": a qualified name '
            "must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
            "with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex "
            "used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional "
            "DNS subdomain prefix and '/' (e.g. 'example.com/MyName')",
        ),
    ],
)
def test_label_selector_grammar_errors(selector: str, message: str) -> None:
    from rolloutrun_localcluster import labelparse

    with pytest.raises(labelparse.SelectorError) as error:
        labelparse.parse(selector)
    assert str(error.value) == message


def test_label_selector_grammar_accepts_what_the_server_accepts() -> None:
    from rolloutrun_localcluster import labelparse

    assert labelparse.parse("x in (foo,,baz),y,z notin (),!w,v==1,u!=2,t<5") == [
        ("t", "lt", ("5",)),
        ("u", "!=", ("2",)),
        ("v", "==", ("1",)),
        ("w", "!", ()),
        ("x", "in", ("", "baz", "foo")),
        ("y", "exists", ()),
        ("z", "notin", ("",)),
    ]


def test_generate_name_masks_its_trailing_dash_as_the_server_does() -> None:
    assert kube_names.mask_trailing_dash("web-") == "wea"  # Go drops two, adds 'a'
    meta = {"generateName": "web-", "name": "web-x7k2q"}
    assert validation.name_causes("services", meta) == []
    causes = validation.name_causes("services", {"generateName": "7b-", "name": "7b-x7k2q"})
    assert [cause[1] for cause in causes] == ["metadata.generateName", "metadata.name"]
