"""Kubernetes protobuf request bodies decoded into the JSON objects the store takes.

kubectl sends the built-in kinds it builds itself (``kubectl create namespace``, ``create
configmap``, ``create secret``, ``create service``, ``create token``, ``run``, ``drain``, and
the access reviews of ``auth can-i`` and ``auth whoami``) as
``application/vnd.kubernetes.protobuf``: the four bytes ``k8s\\0``, then a ``runtime.Unknown``
envelope (its ``typeMeta`` names apiVersion and kind, ``raw`` holds the object's own message).
The emulator keeps JSON, so the body is decoded here, once, at the edge: a small wire decoder
(varints, length-delimited fields, fixed32/64) walks the message by the schemas of
``protobuf_schemas.py`` and writes what ``encoding/json`` would have written for the same Go
object (zero scalars omitted, bytes as base64, times as RFC 3339, quantities and
int-or-strings as their JSON form). Pure functions; the server calls ``request_body``. The
few writers of the wire format (``write_*``) serve the protobuf OpenAPI v2 document.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from . import errors
from .errors import ApiError
from .protobuf_schemas import ANY_VERSION, STRING_LISTS
from .protobuf_schemas import KEEP_ZERO as CORE_KEEP_ZERO
from .protobuf_schemas import MESSAGES as CORE_MESSAGES
from .protobuf_schemas import ROOTS as CORE_ROOTS
from .protobuf_schemas_apps import APPS_KEEP_ZERO, APPS_MESSAGES, APPS_ROOTS
from .store import rfc3339

MESSAGES = {**CORE_MESSAGES, **APPS_MESSAGES}
ROOTS = {**CORE_ROOTS, **APPS_ROOTS}
KEEP_ZERO = CORE_KEEP_ZERO | APPS_KEEP_ZERO

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"
VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
SCALARS = frozenset("siybd")
# Go's zero time.Time (0001-01-01T00:00:00Z) as Unix seconds: JSON writes it as null.
ZERO_TIME_SECONDS = -62135596800


class ProtobufError(ValueError):
    """The body is not a valid encoding of the message it claims to be."""


class UnknownKind(ValueError):
    """The body is valid protobuf of a kind this emulator has no schema for."""


@dataclass(frozen=True)
class Field:
    name: str
    type: str  # a scalar code (s, i, y, b, d) or a message name
    repeated: bool = False
    map_value: str | None = None  # the value type of a map<string, T> field


def parse_spec(spec: str) -> dict[int, Field]:
    """``"1 name s, 11 labels {s:s}, 13 ownerReferences [OwnerReference]"`` as fields."""
    fields: dict[int, Field] = {}
    for entry in spec.split(", "):
        number, name, code = entry.split(" ")
        if code.startswith("{s:"):
            fields[int(number)] = Field(name, "map", map_value=code[3:-1])
        elif code.startswith("["):
            fields[int(number)] = Field(name, code[1:-1], repeated=True)
        else:
            fields[int(number)] = Field(name, code)
    return fields


SCHEMAS: dict[str, dict[int, Field]] = {name: parse_spec(s) for name, s in MESSAGES.items()}


# ---------------------------------------------------------------------------- wire format
def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The unsigned varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise ProtobufError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ProtobufError("varint longer than 10 bytes")


def signed(value: int) -> int:
    """An int32/int64 varint as Go reads it (negative numbers are 10-byte two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def write_varint(value: int) -> bytes:
    """``value`` as a varint (a negative number as Go writes an int64: ten bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def write_key(number: int, wire: int) -> bytes:
    """The key that starts field ``number`` of wire type ``wire``."""
    return write_varint(number << 3 | wire)


def write_length(number: int, data: bytes) -> bytes:
    """Field ``number`` as a length-delimited field holding ``data``."""
    return write_key(number, LENGTH) + write_varint(len(data)) + data


def iter_fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` for each field of one message, in wire order."""
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ProtobufError("field number 0")
        value: int | bytes
        if wire == VARINT:
            value, pos = read_varint(data, pos)
        elif wire in (FIXED64, FIXED32):
            size = 8 if wire == FIXED64 else 4
            if pos + size > len(data):
                raise ProtobufError(f"truncated fixed{size * 8} field {number}")
            value, pos = data[pos : pos + size], pos + size
        elif wire == LENGTH:
            size, pos = read_varint(data, pos)
            if pos + size > len(data):
                raise ProtobufError(f"field {number} is longer than its message")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ProtobufError(f"field {number} has unsupported wire type {wire}")
        yield number, wire, value


# ---------------------------------------------------------------------------- values
def _scalar(code: str, wire: int, value: int | bytes, where: str) -> Any:
    if code in "sy":
        if not isinstance(value, bytes):
            raise ProtobufError(f"{where}: expected a length-delimited field, got wire {wire}")
        if code == "y":
            return base64.b64encode(value).decode()
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ProtobufError(f"{where}: the string is not UTF-8") from error
    if code in "ib":
        if not isinstance(value, int):
            raise ProtobufError(f"{where}: expected a varint, got wire type {wire}")
        return bool(value) if code == "b" else signed(value)
    if isinstance(value, bytes) and len(value) in (4, 8):
        return struct.unpack("<d" if len(value) == 8 else "<f", value)[0]
    raise ProtobufError(f"{where}: expected a fixed-width float, got wire type {wire}")


def _packed(code: str, data: bytes, where: str) -> list[Any]:
    """A packed repeated varint field (proto3 style; accepted as the real decoder does)."""
    values, pos = [], 0
    while pos < len(data):
        value, pos = read_varint(data, pos)
        values.append(_scalar(code, VARINT, value, where))
    return values


def _fields(data: bytes) -> dict[int, int | bytes]:
    """The fields of a small fixed message by number (the last occurrence wins)."""
    return {number: value for number, _, value in iter_fields(data)}


def _int(value: int | bytes | None) -> int:
    if isinstance(value, bytes):
        raise ProtobufError("expected a varint, got a length-delimited field")
    return signed(value or 0)


def _time(data: bytes, micro: bool) -> str | None:
    fields = _fields(data)
    seconds, nanos = _int(fields.get(1)), _int(fields.get(2))
    if seconds == ZERO_TIME_SECONDS and not nanos:
        return None
    moment = datetime.fromtimestamp(seconds, UTC)
    if micro:
        return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{nanos // 1000:06d}Z"
    return rfc3339(moment)


def _int_or_string(data: bytes) -> int | str:
    fields = _fields(data)
    if _int(fields.get(1)):
        return str(_scalar("s", LENGTH, fields.get(3, b""), "IntOrString.strVal"))
    return _int(fields.get(2))


def _raw_json(data: bytes, where: str) -> Any:
    raw = _fields(data).get(1, b"")
    if not raw:
        return None
    if not isinstance(raw, bytes):
        raise ProtobufError(f"{where}: expected a length-delimited field, got a varint")
    try:
        return json.loads(raw)
    except ValueError as error:
        raise ProtobufError(f"{where}: the embedded JSON does not parse: {error}") from error


def _string_list(data: bytes, message: str) -> list[str]:
    """A ``STRING_LISTS`` message (``repeated string items = 1``) as the bare JSON list."""
    items = []
    for number, wire, raw in iter_fields(data):
        if number != 1:
            raise ProtobufError(f"field {number} of {message} is not known to the local cluster")
        items.append(_scalar("s", wire, raw, f"{message}.items"))
    return items


def _special(message: str, data: bytes) -> Any:
    """The messages whose JSON form is not an object of their fields."""
    if message in ("Time", "MicroTime"):
        return _time(data, micro=message == "MicroTime")
    if message == "Quantity":
        return _scalar("s", LENGTH, _fields(data).get(1, b""), "Quantity")
    if message == "IntOrString":
        return _int_or_string(data)
    if message in STRING_LISTS:
        return _string_list(data, message)
    return _raw_json(data, message)  # RawExtension, FieldsV1


SPECIAL = STRING_LISTS | {
    "Time",
    "MicroTime",
    "Quantity",
    "IntOrString",
    "RawExtension",
    "FieldsV1",
}


def _value(code: str, wire: int, value: int | bytes, where: str) -> Any:
    if code in SCALARS:
        return _scalar(code, wire, value, where)
    if not isinstance(value, bytes):
        raise ProtobufError(f"{where}: expected an embedded {code}, got wire type {wire}")
    return _special(code, value) if code in SPECIAL else decode_message(value, code)


def _map_entry(field: Field, data: bytes, where: str) -> tuple[str, Any]:
    assert field.map_value is not None
    key, value = "", None
    for number, wire, raw in iter_fields(data):
        if number == 1:
            key = _scalar("s", wire, raw, f"{where} key")
        elif number == 2:
            value = _value(field.map_value, wire, raw, f"{where}[{key}]")
    if value is None:  # a zero value is left off the wire
        zero: list[str] | dict[str, Any] = [] if field.map_value in STRING_LISTS else {}
        value = {"s": "", "y": "", "i": 0, "b": False, "d": 0.0}.get(field.map_value, zero)
    return key, value


def decode_message(data: bytes, message: str) -> dict[str, Any]:
    """One message as the JSON object ``encoding/json`` writes for it."""
    schema = SCHEMAS.get(message)
    if schema is None:
        raise ProtobufError(f"no schema for message {message}")
    result: dict[str, Any] = {}
    for number, wire, raw in iter_fields(data):
        field = schema.get(number)
        if field is None:
            raise ProtobufError(f"field {number} of {message} is not known to the local cluster")
        where = f"{message}.{field.name}"
        if field.type == "map":
            assert isinstance(raw, bytes), where
            key, value = _map_entry(field, raw, where)
            result.setdefault(field.name, {})[key] = value
        elif field.repeated and wire == LENGTH and field.type in ("i", "b"):
            assert isinstance(raw, bytes)
            result.setdefault(field.name, []).extend(_packed(field.type, raw, where))
        elif field.repeated:
            result.setdefault(field.name, []).append(_value(field.type, wire, raw, where))
        else:
            result[field.name] = _value(field.type, wire, raw, where)
    return {name: value for name, value in result.items() if not _omitted(name, value)}


def _omitted(name: str, value: Any) -> bool:
    """What ``omitempty`` leaves out: zero scalars, except in pointer fields (``KEEP_ZERO``)."""
    if value is None:
        return True
    if isinstance(value, dict | list) or name in KEEP_ZERO:
        return False
    return value in ("", 0, False)


# ---------------------------------------------------------------------------- envelope
def decode_object(body: bytes) -> dict[str, Any]:
    """A whole ``k8s\\0`` + ``runtime.Unknown`` body as a JSON object with apiVersion and kind."""
    if not body.startswith(MAGIC):
        raise ProtobufError("the body does not start with the Kubernetes protobuf prefix k8s\\0")
    envelope = _fields(body[len(MAGIC) :])
    type_meta = envelope.get(1, b"")
    if not isinstance(type_meta, bytes):
        raise ProtobufError("runtime.Unknown.typeMeta is not a message")
    names = _fields(type_meta)
    api_version = _scalar("s", LENGTH, names.get(1, b""), "TypeMeta.apiVersion")
    kind = _scalar("s", LENGTH, names.get(2, b""), "TypeMeta.kind")
    encoding = envelope.get(3, b"")
    if encoding:
        raise ProtobufError(f"content encoding {encoding!r} is not supported")
    message = ROOTS.get((api_version, kind)) or (kind if kind in ANY_VERSION else None)
    if message is None:
        raise UnknownKind(f"{api_version}, Kind={kind}")
    raw = envelope.get(2, b"")
    if not isinstance(raw, bytes):
        raise ProtobufError("runtime.Unknown.raw is not bytes")
    return {"apiVersion": api_version, "kind": kind, **decode_message(raw, message)}


def request_body(body: bytes) -> dict[str, Any]:
    """``decode_object`` with its failures as the API errors the server answers."""
    try:
        return decode_object(body)
    except UnknownKind as error:
        raise ApiError(
            415,
            "UnsupportedMediaType",
            f'the local cluster cannot decode "{error}" from {MEDIA_TYPE} '
            "(it decodes the built-in kinds kubectl creates imperatively); "
            "send this object as application/json",
        ) from error
    except ProtobufError as error:
        raise errors.bad_request(f"the protobuf body does not decode: {error}") from error
