"""The data plane's npz writer: archives ``np.load(allow_pickle=False)`` reads back exactly
(every dtype and layout the columns use), deterministic bytes, and nothing that needs
pickle."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import pytest

from rolloutrun_runtime.data_plane.npz import npz_bytes
from rolloutrun_runtime.data_plane.store import pack_segment, unpack_segment

ARRAYS = {
    "train.0": np.arange(50, dtype=np.int64),
    "train.0.shapes": np.ones((16, 1), np.int64),
    "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "scalar": np.array(3.5),
    "flags": np.array([True, False]),
    "text": np.array(["ab", "c"]),
    "empty": np.zeros((0, 2), np.float32),
    "big_endian": np.array([[1, 2]], dtype=">i4"),
    "strided": np.arange(20, dtype=np.int16)[::3],
    "record": np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
    "segment_index": np.frombuffer(json.dumps({"x": list(range(300))}).encode(), np.uint8),
}


def test_np_load_reads_back_every_array_as_written() -> None:
    data = npz_bytes(ARRAYS)
    assert zipfile.ZipFile(io.BytesIO(data)).testzip() is None
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        assert npz.files == list(ARRAYS)
        for name, array in ARRAYS.items():
            read = npz[name]
            assert (read.dtype, read.shape) == (array.dtype, array.shape), name
            assert np.array_equal(read, array), name
    with np.load(io.BytesIO(npz_bytes({})), allow_pickle=False) as npz:
        assert npz.files == []


def test_equal_arrays_give_equal_bytes() -> None:
    """A fixed member date: a segment's name (its hash) depends on its rows alone."""
    assert npz_bytes(ARRAYS) == npz_bytes({k: v.copy() for k, v in ARRAYS.items()})
    rows = {"train": {"g0_g0": {"ids": np.arange(5), "reward": 1.0, "who": "gym-0"}}}
    first = pack_segment(rows)
    assert pack_segment(rows) == first
    read = unpack_segment(first)["train"]["g0_g0"]
    assert np.array_equal(read["ids"], np.arange(5)) and read["who"] == "gym-0"


def test_an_object_array_is_refused() -> None:
    with pytest.raises(ValueError, match="pickle"):
        npz_bytes({"objects": np.array([{"a": 1}], dtype=object)})
