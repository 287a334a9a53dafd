"""``GET /openapi/v2``: the Swagger 2.0 document, as JSON or as the protobuf clients ask for.

client-go's ``OpenAPISchema()`` (kubectl's client-side apply, helm, anything validating on
the client) asks for ``application/com.github.proto-openapi.spec.v2@v1.0+protobuf`` and
decodes gnostic's ``openapi.v2.Document`` message; other clients take JSON. Without this
document kubectl falls back, helm with ``--server-side=false`` stops ("failed to download
openapi"). The definitions are those of the v3 document (``openapi.definitions``); there
are no paths: clients then pick patch types from their compiled-in knowledge, as with a
server whose v2 document lacks a kind.

The protobuf encoder writes the messages used here (Document, Info, Definitions, NamedSchema,
Schema and its helpers) with the wire format writers of protobuf.py; field numbers are those
of gnostic's ``openapiv2/OpenAPIv2.proto``.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import yaml

from . import openapi
from .protobuf import FIXED64, VARINT, write_key, write_length, write_varint
from .resources import VERSION_INFO, Registry

PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
# What the real server answers it with (``@`` is not valid in a media type: Go's mime refuses).
PROTOBUF_RETURNED = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"

# Schema fields of gnostic's ``Schema`` message: JSON name -> (number, kind).
_STRING = {"$ref": 1, "format": 2, "title": 3, "description": 4, "pattern": 13}
_DOUBLE = {"multipleOf": 6, "maximum": 7, "minimum": 9}
_BOOL = {"exclusiveMaximum": 8, "exclusiveMinimum": 10, "uniqueItems": 16, "readOnly": 27}
_INT = {
    "maxLength": 11,
    "minLength": 12,
    "maxItems": 14,
    "minItems": 15,
    "maxProperties": 17,
    "minProperties": 18,
}
_DEFAULT, _REQUIRED, _ENUM, _ADDITIONAL, _TYPE, _ITEMS, _ALL_OF = 5, 19, 20, 21, 22, 23, 24
_PROPERTIES, _EXAMPLE, _VENDOR = 25, 30, 31


def document(registry: Registry) -> dict[str, Any]:
    """The Swagger 2.0 document of every served kind."""
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": VERSION_INFO["gitVersion"]},
        "paths": {},
        "definitions": openapi.definitions(registry.all()),
    }


def wants_protobuf(accept: str) -> bool:
    return PROTOBUF in accept or PROTOBUF_RETURNED in accept


# --------------------------------------------------------------------- wire format
# The wire format itself (varints, keys, length-delimited fields) is protobuf.py's.
def _string(number: int, text: str) -> bytes:
    return write_length(number, text.encode())


def _any(number: int, value: Any) -> bytes:
    """gnostic's ``Any``: the value as YAML text (field 2)."""
    text = yaml.safe_dump(value, default_flow_style=False, sort_keys=True)
    return write_length(number, _string(2, text))


def encode_schema(schema: dict[str, Any]) -> bytes:
    """A JSON schema as gnostic's ``Schema`` message (unknown v3-only keywords dropped)."""
    out = bytearray()
    for key, value in schema.items():
        if key in _STRING and isinstance(value, str):
            out += _string(_STRING[key], value)
        elif key in _DOUBLE and isinstance(value, int | float):
            out += write_key(_DOUBLE[key], FIXED64) + struct.pack("<d", float(value))
        elif key in _BOOL and isinstance(value, bool):
            out += write_key(_BOOL[key], VARINT) + write_varint(int(value))
        elif key in _INT and isinstance(value, int):
            out += write_key(_INT[key], VARINT) + write_varint(value)
        elif key == "default":
            out += _any(_DEFAULT, value)
        elif key == "example":
            out += _any(_EXAMPLE, value)
        elif key == "required":
            out += b"".join(_string(_REQUIRED, name) for name in value)
        elif key == "enum":
            out += b"".join(_any(_ENUM, item) for item in value)
        elif key == "type":
            types = value if isinstance(value, list) else [value]
            out += write_length(_TYPE, b"".join(_string(1, t) for t in types))
        elif key == "items" and isinstance(value, dict):
            out += write_length(_ITEMS, write_length(1, encode_schema(value)))
        elif key == "allOf":
            out += b"".join(write_length(_ALL_OF, encode_schema(s)) for s in value)
        elif key == "additionalProperties":
            inner = write_length(1, encode_schema(value)) if isinstance(value, dict) else b""
            if isinstance(value, bool):
                inner = write_key(2, VARINT) + write_varint(int(value))
            out += write_length(_ADDITIONAL, inner)
        elif key == "properties":
            named = b"".join(
                write_length(1, _string(1, name) + write_length(2, encode_schema(sub)))
                for name, sub in value.items()
            )
            out += write_length(_PROPERTIES, named)
        elif key.startswith("x-"):
            out += write_length(_VENDOR, _string(1, key) + _any(2, value))
    return bytes(out)


def encode_document(doc: dict[str, Any]) -> bytes:
    """The document as gnostic's ``openapi.v2.Document`` (paths are always empty here)."""
    info = doc.get("info") or {}
    out = _string(1, doc.get("swagger", "2.0"))
    out += write_length(2, _string(1, info.get("title", "")) + _string(2, info.get("version", "")))
    out += write_length(8, b"")
    named = b"".join(
        write_length(1, _string(1, name) + write_length(2, encode_schema(schema)))
        for name, schema in (doc.get("definitions") or {}).items()
    )
    return out + write_length(9, named)


def render(registry: Registry, accept: str) -> tuple[bytes, str]:
    """The body and content type for ``GET /openapi/v2`` with this ``Accept`` header."""
    doc = document(registry)
    if wants_protobuf(accept):
        return encode_document(doc), PROTOBUF_RETURNED
    return json.dumps(doc).encode(), "application/json"
