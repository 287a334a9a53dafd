"""An ``.npz`` writer for the data plane's column arrays: the bytes ``np.load`` reads, without
``zipfile``'s per-member cost.

Why: a rollout snapshot writes a data segment (an npz of a few dozen small column arrays)
on the trainer's interpreter, and ``np.savez`` spends most of its time in ``zipfile``'s
Python code per member (headers, a ``ZipInfo``, a date, seeks): ~0.4 ms for 19 small
arrays against ~0.1 ms for the arrays' own bytes. The archive is the same format (stored
members, each a ``.npy`` of format 1.0), so every reader, ``np.load(allow_pickle=False)``
included, reads it as before: nothing about the files changes but their zip headers, which
now carry a fixed date, so equal arrays give equal bytes (and equal segment names).

Object arrays are refused (nothing here is ever pickled); an archive past the classic zip's
4 GiB limits is left to ``np.savez`` (zip64).
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Mapping

import numpy as np

#: The classic zip format's size and offset limit (larger archives need zip64).
ZIP32_LIMIT = 0xFFFFFFFF
#: DOS date of every member: 1980-01-01 00:00 (zip's epoch), so the bytes are deterministic.
DOS_TIME, DOS_DATE = 0, (0 << 9) | (1 << 5) | 1
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
#: ``.npy`` format 1.0: the magic string and version, then the header's length (2 bytes).
NPY_MAGIC = b"\x93NUMPY\x01\x00"
NPY_PREAMBLE = len(NPY_MAGIC) + 2


def npy_bytes(array: np.ndarray) -> list[bytes]:
    """One array as a ``.npy`` (format 1.0): its header, then its data in C order."""
    if array.dtype.hasobject:
        raise ValueError(f"an array of dtype {array.dtype} would need pickle")
    if not array.flags.c_contiguous:
        array = array.copy(order="C")  # (a 0-d array stays 0-d, unlike ascontiguousarray)
    descr = np.lib.format.dtype_to_descr(array.dtype)
    text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {array.shape!r}, }}"
    # magic, version 1.0, the header's length, the header padded with spaces and a newline
    # so the data starts at a multiple of 64 bytes (as numpy writes it)
    pad = -(NPY_PREAMBLE + len(text) + 1) % 64
    header = f"{text}{' ' * pad}\n".encode("latin1")
    return [NPY_MAGIC + struct.pack("<H", len(header)), header, array.tobytes()]


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """``np.savez(buffer, allow_pickle=False, **arrays)``'s archive: each array a stored
    ``<name>.npy`` member, then the central directory."""
    out: list[bytes] = []
    central: list[bytes] = []
    offset = 0
    for name, array in arrays.items():
        parts = npy_bytes(array)
        size = sum(len(part) for part in parts)
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        member = f"{name}.npy".encode()
        if offset + size + _LOCAL.size + len(member) > ZIP32_LIMIT:
            buffer = io.BytesIO()
            np.savez(buffer, allow_pickle=False, **arrays)
            return buffer.getvalue()
        local = _LOCAL.pack(
            0x04034B50, 20, 0, 0, DOS_TIME, DOS_DATE, crc, size, size, len(member), 0
        )
        central.append(
            _CENTRAL.pack(
                0x02014B50,
                20,
                20,
                0,
                0,
                DOS_TIME,
                DOS_DATE,
                crc,
                size,
                size,
                len(member),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + member
        )
        out += [local, member, *parts]
        offset += len(local) + len(member) + size
    directory = b"".join(central)
    end = _END.pack(0x06054B50, 0, 0, len(central), len(central), len(directory), offset, 0)
    return b"".join([*out, directory, end])
