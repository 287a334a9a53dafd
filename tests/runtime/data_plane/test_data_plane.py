"""The data plane's rows and checkpoints, and the barrier's slots and exclusive cut."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rolloutrun_runtime.data_plane import (
    BarrierError,
    DataPlane,
    DataPlaneBarrier,
    DataPlaneError,
    RowNotFoundError,
)
from rolloutrun_runtime.data_plane.store import row_keys_in


def _row(n: int) -> dict:
    return {"input_ids": np.arange(n, dtype=np.int64), "reward": 0.5, "group_id": "g", "ok": True}


def test_put_get_clear_list() -> None:
    plane = DataPlane()
    plane.put("train", "grp_g1", _row(3))
    plane.put("train", "grp_g0", _row(2))
    plane.put("staging", "grp_g0_aabc", _row(1))
    assert plane.list("train") == ["grp_g0", "grp_g1"]
    assert plane.get("train", "grp_g1")["reward"] == 0.5
    assert plane.clear("train", ["grp_g0", "missing"]) == 1
    assert plane.list("train") == ["grp_g1"]
    with pytest.raises(RowNotFoundError, match="grp_g0"):
        plane.get("train", "grp_g0")
    with pytest.raises(DataPlaneError, match="unknown partition"):
        plane.put("other", "k", _row(1))
    with pytest.raises(DataPlaneError, match="not storable"):
        plane.put("train", "k", {"x": [1, 2]})


def test_checkpoint_roundtrip_keeps_values_and_types(tmp_path) -> None:
    plane = DataPlane()
    plane.put("train", "a_g0", _row(4))
    plane.put("staging", "a_g1_a1-a1", {"logprobs": np.array([-0.5, -1.0], dtype=np.float32)})
    plane.save_checkpoint(tmp_path / "dp", {"step": 3})
    restored = DataPlane()
    restored.put("train", "stale", _row(1))
    assert restored.load_checkpoint(tmp_path / "dp") == {"step": 3}
    assert restored.list("train") == ["a_g0"]
    row = restored.get("train", "a_g0")
    assert np.array_equal(row["input_ids"], np.arange(4))
    assert row["reward"] == 0.5 and isinstance(row["reward"], float)
    assert row["group_id"] == "g" and row["ok"] is True
    staged = restored.get("staging", "a_g1_a1-a1")["logprobs"]
    assert isinstance(staged, np.ndarray) and staged.dtype == np.float32


def test_checkpoint_with_corrupt_rows_fails_closed() -> None:
    plane = DataPlane()
    plane.put("train", "a_g0", _row(4))
    files = plane.to_files({})
    files["rows.npz"] = files["rows.npz"][:-1] + bytes([files["rows.npz"][-1] ^ 1])
    with pytest.raises(DataPlaneError, match="sha256"):
        DataPlane.from_files(files)


def _assert_same_rows(left: DataPlane, right: DataPlane) -> None:
    for partition in ("train", "staging"):
        assert left.list(partition) == right.list(partition)
        for key in left.list(partition):
            a, b = left.get(partition, key), right.get(partition, key)
            assert a.keys() == b.keys(), key
            for field, value in a.items():
                other = b[field]
                assert type(other) is type(value), (key, field)
                if isinstance(value, np.ndarray):
                    assert isinstance(other, np.ndarray)
                    assert (other.dtype, other.shape) == (value.dtype, value.shape), (key, field)
                    assert np.array_equal(other, value), (key, field)
                else:
                    assert other == value, (key, field)


def _mixed_plane() -> DataPlane:
    """Rows that vary in every way a column must survive: dtype, rank, size, missing fields."""
    rng = np.random.default_rng(0)
    plane = DataPlane()
    for i in range(40):
        row: dict = {
            "input_ids": rng.integers(0, 50, size=i % 7, dtype=np.int64),
            "logprobs": rng.standard_normal(i % 5).astype(np.float32),
            "mask": rng.integers(0, 2, size=(2, i % 3), dtype=np.int8),
            "reward": float(rng.standard_normal()),
            "prompt_id": int(rng.integers(0, 2**40)),
            "instance_id": f"gym-{i % 3}" + ("\u00e9" if i % 4 == 0 else ""),
            "ok": bool(i % 2),
        }
        if i % 6 == 0:
            row["scalar_array"] = np.array(i, dtype=np.int32)  # rank 0
            row["reward"] = i  # an int where other rows have a float
            del row["logprobs"]
        if i % 10 == 0:
            row["input_ids"] = row["input_ids"].astype(np.int32)  # another dtype
        plane.put("train" if i % 4 else "staging", f"k{i:02d}", row)
    return plane


def test_columns_round_trip_every_row_exactly() -> None:
    plane = _mixed_plane()
    restored, metadata = DataPlane.from_files(plane.to_files({"m": 1}))
    assert metadata == {"m": 1}
    _assert_same_rows(plane, restored)


def test_checkpoints_of_format_1_still_read() -> None:
    """Format 1 (one npz member per row field), built the way its writer laid it out."""
    import hashlib
    import io
    import json

    plane = _mixed_plane()
    arrays: dict[str, np.ndarray] = {}
    index: dict = {}
    kinds_of = {bool: "bool", int: "int", float: "float", str: "str"}
    for partition in ("train", "staging"):
        index[partition] = {}
        for key in plane.list(partition):
            specs = {}
            for field, value in plane.get(partition, key).items():
                kind = "array" if isinstance(value, np.ndarray) else kinds_of[type(value)]
                name = str(len(arrays))
                arrays[name] = np.asarray(value)
                specs[field] = f"{kind}:{name}"
            index[partition][key] = specs
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    rows = buffer.getvalue()
    meta = {
        "user": {},
        "format": 1,
        "rows_sha256": hashlib.sha256(rows).hexdigest(),
        "index": index,
    }
    files = {"rows.npz": rows, "metadata.json": json.dumps(meta).encode()}
    restored, _ = DataPlane.from_files(files)
    _assert_same_rows(plane, restored)
    expected = {partition: plane.list(partition) for partition in ("train", "staging")}
    assert row_keys_in(meta) == expected
    assert row_keys_in(json.loads(plane.to_files({})["metadata.json"])) == expected


def test_an_unknown_format_or_a_damaged_index_is_refused() -> None:
    import json

    plane = _mixed_plane()
    files = plane.to_files({})
    meta = json.loads(files["metadata.json"])
    meta["format"] = 9
    with pytest.raises(DataPlaneError, match="format 9 is not supported"):
        DataPlane.from_files({**files, "metadata.json": json.dumps(meta).encode()})
    meta = json.loads(files["metadata.json"])
    meta["index"]["train"]["columns"][0]["rows"].append(999)
    with pytest.raises(DataPlaneError, match="malformed"):
        DataPlane.from_files({**files, "metadata.json": json.dumps(meta).encode()})


async def test_checkpoint_cut_drains_mutations_and_blocks_new_ones() -> None:
    barrier = DataPlaneBarrier()
    order: list[str] = []
    release = asyncio.Event()

    async def long_mutation() -> None:
        async with barrier.mutation("group_commits"):
            order.append("mutation-start")
            await release.wait()
            order.append("mutation-end")

    async def cutter() -> None:
        async with barrier.checkpoint() as cut:
            order.append(f"cut@{cut.mutation_version}")
            await asyncio.sleep(0)
            order.append("cut-end")

    async def late_mutation() -> None:
        async with barrier.mutation("prompt_reservations"):
            order.append("late")

    first = asyncio.create_task(long_mutation())
    await asyncio.sleep(0)
    cut_task = asyncio.create_task(cutter())
    await asyncio.sleep(0)
    assert barrier.checkpoint_in_progress
    late = asyncio.create_task(late_mutation())
    await asyncio.sleep(0)
    assert order == ["mutation-start"]
    assert barrier.active_mutations() == {"group_commits": 1}
    release.set()
    await asyncio.gather(first, cut_task, late)
    assert order == ["mutation-start", "mutation-end", "cut@1", "cut-end", "late"]
    assert barrier.mutation_version == 2
    telemetry = barrier.wait_telemetry()
    assert set(telemetry) == {"checkpoint", "group_commits", "prompt_reservations"}
    assert telemetry["prompt_reservations"]["count"] == 1


async def test_cut_proofs_expire_and_nesting_is_refused() -> None:
    barrier = DataPlaneBarrier()
    async with barrier.mutation("x") as cut:
        cut.require_live()
        with pytest.raises(BarrierError, match="deadlock"):
            async with barrier.checkpoint():
                pass
    with pytest.raises(BarrierError, match="released"):
        cut.require_live()
    async with barrier.checkpoint() as exclusive:
        exclusive.require_live()
    with pytest.raises(BarrierError):
        exclusive.require_live()


async def test_cancelled_holder_releases_its_slot() -> None:
    barrier = DataPlaneBarrier()
    entered = asyncio.Event()

    async def holder() -> None:
        async with barrier.mutation("sample_clears"):
            entered.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(holder())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert barrier.active_mutations() == {}
    async with barrier.checkpoint() as cut:
        assert cut.mutation_version == 1


def test_a_copy_is_the_store_at_its_moment_read_only_and_costs_what_changed() -> None:
    plane = DataPlane()
    for n in range(50):
        plane.put("train", f"t{n}", _row(n))
    first = plane.copy()
    assert first.changed_rows() == {"train": 0, "staging": 0}  # copied whole
    plane.put("train", "t3", _row(300))
    plane.clear("train", ["t4"])
    plane.put("staging", "s0", _row(0))
    second = plane.copy()
    assert second.changed_rows() == {"train": 2, "staging": 1}
    plane.put("train", "t5", _row(500))  # after the copy: not in it
    assert second.list("train") == sorted(f"t{n}" for n in range(50) if n != 4)
    assert len(second.get("train", "t3")["input_ids"]) == 300
    assert len(second.get("train", "t5")["input_ids"]) == 5
    assert first.contains("train", "t4") and not first.contains("staging", "s0")
    with pytest.raises(DataPlaneError, match="read-only"):
        second.put("train", "t9", _row(9))
    with pytest.raises(DataPlaneError, match="read-only"):
        second.clear("train", ["t9"])
    restored, _ = DataPlane.from_files(plane.to_files({}))
    restored.put("train", "t60", _row(60))  # a restored store's copies work the same way
    assert "t60" in restored.copy().list("train")
    restored.clear("train", ["t60"])
    assert restored.copy().changed_rows() == {"train": 1, "staging": 0}
