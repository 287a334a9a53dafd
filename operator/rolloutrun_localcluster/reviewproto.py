"""Protobuf request bodies of the computed creates (access reviews, TokenRequests) as JSON.

Why: kubectl sends built-in kinds as ``application/vnd.kubernetes.protobuf``, the access
reviews of ``kubectl auth can-i`` and the TokenRequest of ``kubectl create token``
included. A body is the ``k8s\\0`` magic and a ``runtime.Unknown`` envelope around the
object's protobuf; this decodes the wire format against the few message layouts those
kinds use (field numbers from k8s.io/api ``generated.proto``) and nothing else.
"""

from __future__ import annotations

from typing import Any

from . import errors

MAGIC = b"k8s\x00"
#: message name -> field number -> (json name, type, repeated); type is a message name,
#: "string" or "int".
Schema = dict[int, tuple[str, str, bool]]
MESSAGES: dict[str, Schema] = {
    "Unknown": {1: ("typeMeta", "TypeMeta", False), 2: ("raw", "bytes", False)},
    "TypeMeta": {1: ("apiVersion", "string", False), 2: ("kind", "string", False)},
    "Object": {2: ("spec", "Spec", False)},
    "Spec": {
        1: ("resourceAttributes", "ResourceAttributes", False),
        2: ("nonResourceAttributes", "NonResourceAttributes", False),
        3: ("user", "string", False),
        4: ("groups", "string", True),
        6: ("uid", "string", False),
    },
    "ResourceAttributes": {
        1: ("namespace", "string", False),
        2: ("verb", "string", False),
        3: ("group", "string", False),
        4: ("version", "string", False),
        5: ("resource", "string", False),
        6: ("subresource", "string", False),
        7: ("name", "string", False),
    },
    "NonResourceAttributes": {1: ("path", "string", False), 2: ("verb", "string", False)},
    "RulesSpec": {1: ("namespace", "string", False)},
    "TokenSpec": {
        1: ("audiences", "string", True),
        4: ("expirationSeconds", "int", False),
    },
}
#: The spec message of each computed kind (SelfSubjectReview has no spec).
SPECS = {"SelfSubjectRulesReview": "RulesSpec", "TokenRequest": "TokenSpec"}


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise errors.bad_request("protobuf body ends inside a varint")
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """``(field number, value)`` pairs of one message (varints and length-delimited)."""
    found: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(data, at)
            found.append((number, value))
        elif wire == 2:
            size, at = _varint(data, at)
            found.append((number, data[at : at + size]))
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise errors.bad_request(f"protobuf wire type {wire} is not supported")
    return found


def decode(data: bytes, message: str, spec: str = "Spec") -> dict[str, Any]:
    """One message as JSON, by :data:`MESSAGES` (unknown fields skipped)."""
    schema = MESSAGES["Object"] if message == "Object" else MESSAGES[message]
    result: dict[str, Any] = {}
    for number, value in _fields(data):
        if number not in schema:
            continue
        name, kind, repeated = schema[number]
        if message == "Object" and name == "spec":
            kind = spec
        item: Any
        if kind == "int" or kind == "bytes":
            item = value
        elif kind == "string":
            item = bytes(value).decode() if isinstance(value, bytes) else value
        else:
            item = decode(value if isinstance(value, bytes) else b"", kind)
        if repeated:
            result.setdefault(name, []).append(item)
        else:
            result[name] = item
    return result


def decode_body(raw: bytes) -> dict[str, Any]:
    """A computed create's protobuf body as the JSON object it stands for."""
    if not raw.startswith(MAGIC):
        raise errors.bad_request("protobuf body without the k8s magic prefix")
    envelope = decode(raw[len(MAGIC) :], "Unknown")
    type_meta = envelope.get("typeMeta") or {}
    kind = type_meta.get("kind", "")
    obj = decode(envelope.get("raw") or b"", "Object", SPECS.get(kind, "Spec"))
    return {"apiVersion": type_meta.get("apiVersion", ""), "kind": kind, **obj}
