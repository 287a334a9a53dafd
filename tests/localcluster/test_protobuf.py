"""The protobuf request decoder: wire format, JSON forms of the special messages, omitempty,
and the errors a body the emulator cannot decode gets. (kubectl's own bodies are decoded in
test_kubectl_everyday.py, its access reviews in test_rbac.py; these cover what kubectl's
everyday commands do not send, and each field of the review kinds.)"""

from __future__ import annotations

import struct

import pytest

from rolloutrun_localcluster import protobuf
from rolloutrun_localcluster.errors import ApiError

# The writers are protobuf.py's own, checked against google.protobuf by test_managed_fields.py.
varint = protobuf.write_varint


def field(number: int, value: int | bytes | str, fixed: int = 0) -> bytes:
    if isinstance(value, str):
        value = value.encode()
    if fixed:
        wire = protobuf.FIXED64 if fixed == 8 else protobuf.FIXED32
        return protobuf.write_key(number, wire) + bytes(value)
    if isinstance(value, int):
        return protobuf.write_key(number, protobuf.VARINT) + varint(value)
    return protobuf.write_length(number, value)


def envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    type_meta = field(1, api_version) + field(2, kind)
    return protobuf.MAGIC + field(1, type_meta) + field(2, raw) + field(3, "") + field(4, "")


def meta(name: str, **extra: bytes) -> bytes:
    # Go always writes the non-pointer fields, zero or not: name, generateName, namespace,
    # ..., and creationTimestamp as Go's zero time.
    zero_time = field(1, protobuf.ZERO_TIME_SECONDS) + field(2, 0)
    body = field(1, name) + field(2, "") + field(3, "") + field(7, 0) + field(8, zero_time)
    return body + b"".join(extra.values())


def test_a_configmap_decodes_with_maps_bytes_and_empty_values() -> None:
    labels = field(11, field(1, "app") + field(2, "x"))
    raw = (
        field(1, meta("cm", labels=labels))
        + field(2, field(1, "a") + field(2, "b"))
        + field(2, field(1, "empty"))  # a zero value is left off the entry
        + field(3, field(1, "blob") + field(2, b"\x00\xff"))
    )
    obj = protobuf.decode_object(envelope("v1", "ConfigMap", raw))
    assert obj == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "cm", "labels": {"app": "x"}},
        "data": {"a": "b", "empty": ""},
        "binaryData": {"blob": "AP8="},
    }


def test_pointer_fields_keep_their_zero_and_others_drop_it() -> None:
    raw = field(1, meta("sa")) + field(4, 0)  # automountServiceAccountToken: false
    obj = protobuf.decode_object(envelope("v1", "ServiceAccount", raw))
    assert obj["automountServiceAccountToken"] is False
    assert obj["metadata"] == {"name": "sa"}


def test_a_deployment_decodes_its_pod_template_and_keeps_zero_replicas() -> None:
    """``kubectl create deployment web --image=x --replicas=0`` (apps/v1 messages, the core
    PodSpec inside); ``replicas`` is a pointer: 0 asks for no pod, it is not left out."""
    container = field(1, "x") + field(2, "x")  # name, image
    template = field(1, meta("", labels=field(11, field(1, "app") + field(2, "web"))))
    template += field(2, field(2, container))  # PodSpec.containers
    strategy = field(1, "RollingUpdate") + field(2, field(1, field(1, 1) + field(3, "25%")))
    selector = field(1, field(1, "app") + field(2, "web"))
    spec = field(1, 0) + field(2, selector) + field(3, template) + field(4, strategy)
    spec += field(5, 0) + field(7, 0)  # minReadySeconds, paused: not pointers, left out
    raw = field(1, meta("web")) + field(2, spec) + field(3, b"")
    obj = protobuf.decode_object(envelope("apps/v1", "Deployment", raw))
    assert obj["spec"] == {
        "replicas": 0,
        "selector": {"matchLabels": {"app": "web"}},
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [{"name": "x", "image": "x"}]},
        },
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "25%"}},
    }


def test_int_or_string_times_quantities_and_negative_numbers() -> None:
    port = field(3, 80) + field(4, field(1, 1) + field(3, "http")) + field(5, 0)
    spec = field(1, port) + field(12, -1)  # healthCheckNodePort, a negative int32
    created = field(8, field(1, 1700000000) + field(2, 0))
    obj = protobuf.decode_object(envelope("v1", "Service", field(1, created) + field(2, spec)))
    assert obj["spec"] == {"ports": [{"port": 80, "targetPort": "http"}], "healthCheckNodePort": -1}
    assert obj["metadata"]["creationTimestamp"] == "2023-11-14T22:13:20Z"
    quota = field(2, field(1, field(1, "cpu") + field(2, field(1, "500m"))))
    obj = protobuf.decode_object(envelope("v1", "ResourceQuota", field(1, meta("q")) + quota))
    assert obj["spec"] == {"hard": {"cpu": "500m"}}
    renew = field(4, field(1, 1700000000) + field(2, 123456789))
    obj = protobuf.decode_object(envelope("coordination.k8s.io/v1", "Lease", field(2, renew)))
    assert obj["spec"] == {"renewTime": "2023-11-14T22:13:20.123456Z"}


def test_packed_repeated_and_fixed_width_fields_decode() -> None:
    # supplementalGroups: unpacked (as Go writes proto2) and packed, both read; runAsUser: 0
    unpacked = field(4, 1000) + field(4, 1001)
    packed = field(4, varint(1002) + varint(1003))
    decoded = protobuf.decode_message(unpacked + packed + field(2, 0), "PodSecurityContext")
    assert decoded == {"supplementalGroups": [1000, 1001, 1002, 1003], "runAsUser": 0}
    fields = list(protobuf.iter_fields(field(3, struct.pack("<d", 1.5), fixed=8)))
    assert fields == [(3, protobuf.FIXED64, struct.pack("<d", 1.5))]
    assert list(protobuf.iter_fields(field(2, b"\x01\x00\x00\x00", fixed=4))) == [
        (2, protobuf.FIXED32, b"\x01\x00\x00\x00")
    ]


def test_an_unknown_kind_is_a_415_naming_it() -> None:
    with pytest.raises(ApiError) as caught:
        protobuf.request_body(envelope("batch/v1", "Job", field(1, meta("j"))))
    assert caught.value.code == 415
    assert '"batch/v1, Kind=Job"' in caught.value.message
    assert "application/json" in caught.value.message


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (b'{"kind": "ConfigMap"}', "prefix k8s\\0"),
        (envelope("v1", "ConfigMap", field(99, "x")), "field 99 of ConfigMap"),
        (envelope("v1", "ConfigMap", field(1, 5)), "ConfigMap.metadata: expected an embedded"),
        (envelope("v1", "ConfigMap", b"\x0a\x05ab"), "longer than its message"),
        (envelope("v1", "ConfigMap", b"\x0b"), "wire type 3"),
        (envelope("v1", "ConfigMap", field(1, field(1, b"\xff"))), "not UTF-8"),
    ],
)
def test_a_malformed_body_is_a_400_saying_what_is_wrong(body: bytes, text: str) -> None:
    with pytest.raises(ApiError) as caught:
        protobuf.request_body(body)
    assert caught.value.code == 400 and text in caught.value.message, caught.value.message


@pytest.mark.parametrize("api_version", ["v1", "policy/v1", "rolloutrun.dev/v1alpha1"])
def test_delete_options_decode_under_any_group_version(api_version: str) -> None:
    """A typed client's Delete sends DeleteOptions in its own group version; zero grace and
    an explicit orphanDependents=false are pointers, kept."""
    options = field(1, 0) + field(3, 0) + field(4, "Foreground") + field(5, "All")
    obj = protobuf.decode_object(envelope(api_version, "DeleteOptions", options))
    assert obj == {
        "apiVersion": api_version,
        "kind": "DeleteOptions",
        "gracePeriodSeconds": 0,
        "orphanDependents": False,
        "propagationPolicy": "Foreground",
        "dryRun": ["All"],
    }


def test_rbac_and_token_requests_decode_for_kubectl_create_clusterrole_and_token() -> None:
    """What ``kubectl create clusterrole --aggregation-rule`` and ``kubectl create token
    --bound-object-kind=Pod`` send, once those resources are served."""
    rule = field(1, "get") + field(2, "") + field(3, "pods")
    selector = field(1, field(1, "rbac.example.com/aggregate") + field(2, "true"))
    role = field(1, meta("agg")) + field(2, rule) + field(3, field(1, selector))
    obj = protobuf.decode_object(envelope("rbac.authorization.k8s.io/v1", "ClusterRole", role))
    assert obj["rules"] == [{"verbs": ["get"], "apiGroups": [""], "resources": ["pods"]}]
    assert obj["aggregationRule"] == {
        "clusterRoleSelectors": [{"matchLabels": {"rbac.example.com/aggregate": "true"}}]
    }
    bound = field(1, "Pod") + field(2, "v1") + field(3, "p") + field(4, "u-1")
    spec = field(1, "https://kubernetes.default.svc") + field(3, bound) + field(4, 600)
    token = field(1, meta("trainer")) + field(2, spec) + field(3, field(1, ""))
    obj = protobuf.decode_object(envelope("authentication.k8s.io/v1", "TokenRequest", token))
    assert obj["spec"] == {
        "audiences": ["https://kubernetes.default.svc"],
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "p", "uid": "u-1"},
        "expirationSeconds": 600,
    }
    assert obj["status"] == {}


def review_status() -> bytes:
    # SubjectAccessReviewStatus as Go writes an unset one: allowed, reason, evaluationError,
    # denied (none of them pointers, so all on the wire).
    return field(1, 0) + field(2, "") + field(3, "") + field(4, 0)


def test_access_reviews_decode_as_kubectl_auth_can_i_sends_them() -> None:
    """``kubectl auth can-i get pods/log -n team --as alice --as-group dev``: the resource
    attributes, with Go's empty strings and the unset status left out as JSON leaves them."""
    attributes = (
        field(1, "team")
        + field(2, "get")
        + field(3, "")
        + field(4, "")
        + field(5, "pods")
        + field(6, "log")
        + field(7, "")
    )
    raw = field(1, meta("")) + field(2, field(1, attributes)) + field(3, review_status())
    obj = protobuf.decode_object(
        envelope("authorization.k8s.io/v1", "SelfSubjectAccessReview", raw)
    )
    assert obj == {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "metadata": {},
        "spec": {
            "resourceAttributes": {
                "namespace": "team",
                "verb": "get",
                "resource": "pods",
                "subresource": "log",
            }
        },
        "status": {},
    }
    url = field(2, field(1, "/healthz") + field(2, "get"))
    extra = field(5, field(1, "scopes") + field(2, field(1, "a") + field(1, "b")))
    spec = url + field(3, "alice") + field(4, "dev") + field(4, "ops") + extra + field(6, "u-1")
    for kind in ("SubjectAccessReview", "LocalSubjectAccessReview"):
        obj = protobuf.decode_object(envelope("authorization.k8s.io/v1", kind, field(2, spec)))
        assert obj["spec"] == {
            "nonResourceAttributes": {"path": "/healthz", "verb": "get"},
            "user": "alice",
            "groups": ["dev", "ops"],
            "extra": {"scopes": ["a", "b"]},  # an ExtraValue is a bare list in JSON
            "uid": "u-1",
        }


def test_selectors_of_an_access_review_decode() -> None:
    requirement = field(1, "env") + field(2, "In") + field(3, "prod")
    fields_ = field(8, field(1, "spec.nodeName=n1") + field(2, requirement))
    labels = field(9, field(2, requirement))
    spec = field(1, field(2, "list") + field(5, "pods") + fields_ + labels)
    raw = field(2, spec)
    obj = protobuf.decode_object(envelope("authorization.k8s.io/v1", "SubjectAccessReview", raw))
    wanted = {"key": "env", "operator": "In", "values": ["prod"]}
    assert obj["spec"]["resourceAttributes"] == {
        "verb": "list",
        "resource": "pods",
        "fieldSelector": {"rawSelector": "spec.nodeName=n1", "requirements": [wanted]},
        "labelSelector": {"requirements": [wanted]},
    }


def test_rules_and_self_reviews_decode_for_can_i_list_and_whoami() -> None:
    rules = field(1, meta("")) + field(2, field(1, "team")) + field(3, field(3, 0))
    obj = protobuf.decode_object(
        envelope("authorization.k8s.io/v1", "SelfSubjectRulesReview", rules)
    )
    assert obj["spec"] == {"namespace": "team"} and obj["status"] == {}
    whoami = field(1, meta("")) + field(2, field(1, field(1, "") + field(2, "")))
    obj = protobuf.decode_object(envelope("authentication.k8s.io/v1", "SelfSubjectReview", whoami))
    assert obj == {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "SelfSubjectReview",
        "metadata": {},
        "status": {"userInfo": {}},
    }
    info = field(1, "alice") + field(3, "dev") + field(4, field(1, "k") + field(2, field(1, "v")))
    status = field(1, info)
    assert protobuf.decode_message(status, "SelfSubjectReviewStatus") == {
        "userInfo": {"username": "alice", "groups": ["dev"], "extra": {"k": ["v"]}}
    }


def test_token_request_attestations_are_bare_lists() -> None:
    """``TokenRequestSpec.attestations`` is a map of ``AttestationValue`` (a Go []string)."""
    entry = field(1, "node") + field(2, field(1, "n1") + field(1, "n2"))
    spec = field(1, "api") + field(5, entry) + field(5, field(1, "empty"))
    obj = protobuf.decode_object(
        envelope("authentication.k8s.io/v1", "TokenRequest", field(2, spec))
    )
    assert obj["spec"] == {
        "audiences": ["api"],
        "attestations": {"node": ["n1", "n2"], "empty": []},
    }
    with pytest.raises(protobuf.ProtobufError, match="field 2 of AttestationValue"):
        protobuf.decode_message(
            field(5, field(1, "x") + field(2, field(2, "y"))), "TokenRequestSpec"
        )
