"""The pure parts of server-side apply: field sets and their FieldsV1 form, merging by merge
keys, conflicts, removal of fields a manager stopped applying, Update entries, and the
protobuf form of the OpenAPI v2 document (decoded with the protobuf library itself)."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutrun_localcluster import apply, openapi_v2
from rolloutrun_localcluster import managed_fields as mf
from rolloutrun_localcluster.errors import ApiError
from rolloutrun_localcluster.resources import BUILTINS, Registry, ResourceType, types_from_crd

DEPLOYMENT = next(t for t in BUILTINS if t.plural == "deployments")
CONFIGMAP = next(t for t in BUILTINS if t.plural == "configmaps")
NOW = "2026-01-01T00:00:00Z"


def _deployment(image: str, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "labels": {"app": "d"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "d"}},
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "app",
                            "image": image,
                            "args": ["--a"],
                            "ports": [{"containerPort": 80}],
                            "env": [{"name": "X", "value": "1"}],
                            **container,
                        }
                    ]
                }
            },
        },
    }


def test_fieldset_of_an_applied_deployment_reads_as_the_real_servers() -> None:
    applied = mf.strip(_deployment("img:1"), has_status=True, subresource=None)
    fields = mf.encode(mf.fieldset(applied, apply.shape_of(DEPLOYMENT)))
    assert fields == {
        "f:metadata": {"f:labels": {"f:app": {}}},
        "f:spec": {
            "f:replicas": {},
            "f:selector": {},  # a LabelSelector is atomic
            "f:template": {
                "f:spec": {
                    "f:containers": {
                        'k:{"name":"app"}': {
                            ".": {},
                            "f:args": {},  # lists without merge keys are atomic
                            "f:env": {'k:{"name":"X"}': {".": {}, "f:name": {}, "f:value": {}}},
                            "f:image": {},
                            "f:name": {},
                            "f:ports": {
                                'k:{"containerPort":80,"protocol":"TCP"}': {
                                    ".": {},
                                    "f:containerPort": {},
                                }
                            },
                        }
                    }
                }
            },
        },
    }
    assert mf.decode(fields) == mf.fieldset(applied, apply.shape_of(DEPLOYMENT))


def test_paths_print_as_in_conflict_messages() -> None:
    path = ("f:spec", "f:containers", 'k:{"name":"app"}', "f:image")
    assert mf.show_path(path) == '.spec.containers[name="app"].image'
    assert mf.show_path(("f:metadata", "f:finalizers", 'v:"x"')) == '.metadata.finalizers[="x"]'


def test_merge_follows_merge_keys_and_replaces_atomic_lists() -> None:
    live = _deployment("img:1", command=["run"])
    applied = mf.strip(_deployment("img:2", args=["--b"]), has_status=True, subresource=None)
    merged = apply.merge(live, applied, apply.shape_of(DEPLOYMENT))
    (container,) = merged["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "img:2" and container["args"] == ["--b"]
    assert container["command"] == ["run"]  # kept: the item merged by its name


def _request(manager: str, force: bool = False) -> apply.ApplyRequest:
    return apply.ApplyRequest(manager, force, None, NOW)


def _configmap(data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": data}


def _applied(live: dict[str, Any] | None, config: dict[str, Any], request: Any) -> Any:
    merged, entries = apply.apply_config(CONFIGMAP, live, config, request)
    merged.setdefault("metadata", {})["managedFields"] = entries
    return merged


def test_conflicts_force_shared_ownership_and_removal() -> None:
    first = _applied(None, _configmap({"a": "1", "b": "2"}), _request("one"))
    # The same value is shared ownership, a different one a conflict naming manager and field.
    shared = _applied(first, _configmap({"a": "1"}), _request("two"))
    with pytest.raises(ApiError) as refused:
        apply.apply_config(CONFIGMAP, shared, _configmap({"b": "3"}), _request("two"))
    assert refused.value.code == 409
    assert refused.value.message == 'Apply failed with 1 conflict: conflict with "one": .data.b'
    forced = _applied(shared, _configmap({"b": "3"}), _request("two", force=True))
    assert forced["data"] == {"a": "1", "b": "3"}
    owners = {e["manager"]: e["fieldsV1"] for e in forced["metadata"]["managedFields"]}
    assert owners == {"one": {"f:data": {"f:a": {}}}, "two": {"f:data": {"f:b": {}}}}
    # `two` stopped applying `a`; `one` still owns it: it stays. `one` drops it: it goes.
    gone = _applied(forced, _configmap({}), _request("one"))
    assert gone["data"] == {"b": "3"}


def test_a_conflict_with_several_fields_lists_them_by_manager() -> None:
    first = _applied(None, _configmap({"a": "1", "b": "2"}), _request("one"))
    with pytest.raises(ApiError) as refused:
        apply.apply_config(CONFIGMAP, first, _configmap({"a": "x", "b": "y"}), _request("two"))
    assert refused.value.message == (
        'Apply failed with 2 conflicts: conflicts with "one":\n- .data.a\n- .data.b'
    )
    assert [c["field"] for c in (refused.value.details or {})["causes"]] == [".data.a", ".data.b"]


def test_update_entries_move_ownership_and_forget_removed_fields() -> None:
    record_one = apply.recorder(CONFIGMAP, "one", None, lambda: NOW)
    record_two = apply.recorder(CONFIGMAP, "two", None, lambda: "later")
    created = _configmap({"a": "1", "b": "2"})
    created["metadata"]["managedFields"] = record_one(None, created)
    assert created["metadata"]["managedFields"][0]["fieldsV1"] == {
        "f:data": {".": {}, "f:a": {}, "f:b": {}}
    }
    changed = {**created, "data": {"a": "9"}}  # `two` changes a, removes b
    entries = {e["manager"]: e for e in record_two(created, changed)}
    assert entries["two"]["fieldsV1"] == {"f:data": {"f:a": {}}}
    assert entries["one"]["fieldsV1"] == {"f:data": {}}
    # Nothing changed: the entries, times included, stay as they were.
    assert record_one(created, created) == created["metadata"]["managedFields"]


def test_custom_resources_merge_lists_as_their_schema_says() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "pools": {
                        "type": "array",
                        "x-kubernetes-list-type": "map",
                        "x-kubernetes-list-map-keys": ["name"],
                        "items": {"type": "object"},
                    },
                    "args": {"type": "array", "items": {"type": "string"}},
                    "tags": {"type": "array", "x-kubernetes-list-type": "set"},
                },
            }
        },
    }
    rtype = ResourceType("x.dev", "v1", "things", "Thing", True, custom=True, schema=schema)
    shape = apply.shape_of(rtype)
    live = {"spec": {"pools": [{"name": "a", "size": 1}], "args": ["1"], "tags": ["t"]}}
    applied = {"spec": {"pools": [{"name": "b", "size": 2}], "args": ["2"], "tags": ["u"]}}
    merged = apply.merge(live, applied, shape)
    assert merged["spec"] == {
        "pools": [{"name": "a", "size": 1}, {"name": "b", "size": 2}],
        "args": ["2"],
        "tags": ["t", "u"],
    }
    assert mf.encode(mf.fieldset(applied, shape)) == {
        "f:spec": {
            "f:args": {},
            "f:pools": {'k:{"name":"b"}': {".": {}, "f:name": {}, "f:size": {}}},
            "f:tags": {'v:"u"': {}},
        }
    }
    with pytest.raises(ApiError, match="does not contain declared merge key: name"):
        mf.fieldset({"spec": {"pools": [{"size": 1}]}}, shape)


def test_apply_options_are_validated_as_the_real_server() -> None:
    with pytest.raises(ApiError, match="fieldManager: Required value: is required for apply"):
        apply.check_manager(None, True, False)
    with pytest.raises(ApiError, match="force: Forbidden: may not be specified for non-apply"):
        apply.check_manager("m", False, True)
    assert apply.manager_name(None, "kubectl/v1.32.4 (linux/amd64) kubernetes/4cb5f07") == "kubectl"
    assert apply.manager_name("helm", "Helm/4.1.4") == "helm"


def _gnostic_classes() -> dict[str, Any]:
    """Message classes for the part of gnostic's openapi.v2 proto the encoder writes."""
    descriptor_pb2 = pytest.importorskip("google.protobuf.descriptor_pb2")
    from google.protobuf import descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    string, msg, boolean = f.TYPE_STRING, f.TYPE_MESSAGE, f.TYPE_BOOL
    one, many = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    messages = {
        "Document": [("swagger", 1, string, one), ("info", 2, "Info", one),
                     ("definitions", 9, "Definitions", one)],
        "Info": [("title", 1, string, one), ("version", 2, string, one)],
        "Definitions": [("additional_properties", 1, "NamedSchema", many)],
        "NamedSchema": [("name", 1, string, one), ("value", 2, "Schema", one)],
        "Schema": [("description", 4, string, one), ("required", 19, string, many),
                   ("additional_properties", 21, "AdditionalPropertiesItem", one),
                   ("type", 22, "TypeItem", one), ("items", 23, "ItemsItem", one),
                   ("properties", 25, "Properties", one),
                   ("vendor_extension", 31, "NamedAny", many)],
        "AdditionalPropertiesItem": [("schema", 1, "Schema", one), ("boolean", 2, boolean, one)],
        "TypeItem": [("value", 1, string, many)],
        "ItemsItem": [("schema", 1, "Schema", many)],
        "Properties": [("additional_properties", 1, "NamedSchema", many)],
        "NamedAny": [("name", 1, string, one), ("value", 2, "Any", one)],
        "Any": [("yaml", 2, string, one)],
    }  # fmt: skip
    file = descriptor_pb2.FileDescriptorProto(name="gnostic_subset.proto", package="openapi.v2")
    for name, fields in messages.items():
        message = file.message_type.add(name=name)
        for field_name, number, kind, label in fields:
            field = message.field.add(name=field_name, number=number, label=label)
            if isinstance(kind, str):
                field.type, field.type_name = msg, f".openapi.v2.{kind}"
            else:
                field.type = kind
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"openapi.v2.{name}"))
        for name in messages
    }


def test_the_openapi_v2_protobuf_decodes_as_gnostic_messages() -> None:
    registry = Registry()
    crd = {
        "metadata": {"name": "things.x.dev"},
        "spec": {
            "group": "x.dev",
            "names": {"plural": "things", "kind": "Thing"},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "description": "The spec.",
                                    "properties": {"n": {"type": "integer"}},
                                    "additionalProperties": False,
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    registry.put_crd(crd)
    assert types_from_crd(crd)[0].kind == "Thing"
    document = _gnostic_classes()["Document"]()
    document.ParseFromString(openapi_v2.encode_document(openapi_v2.document(registry)))
    assert document.swagger == "2.0"
    schemas = {d.name: d.value for d in document.definitions.additional_properties}
    thing = schemas["dev.x.v1.Thing"]
    assert list(thing.type.value) == ["object"] and list(thing.required) == ["spec"]
    (spec,) = thing.properties.additional_properties
    assert spec.name == "spec" and spec.value.description == "The spec."
    assert spec.value.additional_properties.boolean is False
    (gvk,) = thing.vendor_extension
    assert gvk.name == "x-kubernetes-group-version-kind"
    assert "kind: Thing" in gvk.value.yaml and "group: x.dev" in gvk.value.yaml
    assert "io.k8s.api.apps.v1.Deployment" in schemas
    assert "io.k8s.api.core.v1.ConfigMap" in schemas
