"""A keyed JSON map written as a chain of chunks of what changed: the reader rebuilds the
writer's map in its order, a snapshot writes only what changed, and a missing, truncated or
malformed chunk is refused with an error naming it."""

from __future__ import annotations

import json
import random

import pytest

from rolloutrun_runtime.json_chain import MAX_CHUNKS, ChainError, ChainWriter, read_chain


def _key(sha: str) -> str:
    return f"chunks/{sha}.json"


def _publish(writer: ChainWriter, current: dict[str, str], stored: dict[str, bytes]):
    stage = writer.stage(current, gone=[key for key in writer.keys if key not in stored])
    stored.update(stage.new_files)
    writer.commit(stage)
    return stage


def _read(stage, stored: dict[str, bytes]) -> dict:
    return read_chain(stage.head(), stored, "test")


def test_random_changes_read_back_in_the_writers_order() -> None:
    rng = random.Random(5)
    writer, stored, current = ChainWriter(_key), {}, {}
    next_id = 0
    for _ in range(60):
        for _ in range(rng.randrange(4)):  # new entries at the end
            current[f"g{next_id}"] = json.dumps({"n": next_id})
            next_id += 1
        for key in rng.sample(list(current), min(len(current), rng.randrange(3))):
            current[key] = json.dumps({"n": key, "v": rng.random()})  # changed in place
        for key in rng.sample(list(current), min(len(current), rng.randrange(2))):
            del current[key]
        if current and rng.random() < 0.1:  # dropped and added again: moves to the end
            key = next(iter(current))
            current[key] = current.pop(key)
        stage = _publish(writer, dict(current), stored)
        got = _read(stage, stored)
        assert list(got) == list(current)
        assert got == {key: json.loads(text) for key, text in current.items()}
        assert len(stage.records) <= MAX_CHUNKS


def test_a_snapshot_writes_only_what_changed() -> None:
    writer, stored = ChainWriter(_key), {}
    current = {f"g{i}": json.dumps({"n": i, "pad": "x" * 100}) for i in range(1000)}
    base = _publish(writer, dict(current), stored)
    assert (base.put, base.rewritten) == (1000, True)
    unchanged = _publish(writer, dict(current), stored)
    assert (unchanged.put, unchanged.new_files) == (0, {})
    current["g7"] = json.dumps({"n": 7, "changed": True})
    current["g1000"] = json.dumps({"n": 1000})
    del current["g3"]
    delta = _publish(writer, dict(current), stored)
    assert (delta.put, delta.rewritten, len(delta.records)) == (2, False, 2)
    (data,) = delta.new_files.values()
    assert len(data) < 200  # two entries and a drop, not the map
    assert list(_read(delta, stored)) == list(current)


def test_an_unpublished_stage_leaves_the_chain_as_last_published() -> None:
    writer, stored = ChainWriter(_key), {}
    current = {f"g{i}": json.dumps(i) for i in range(10)}
    _publish(writer, dict(current), stored)
    writer.stage({**current, "lost": "1"})  # never committed (a failed publication)
    current["g11"] = "11"
    stage = _publish(writer, dict(current), stored)
    assert _read(stage, stored) == {key: json.loads(text) for key, text in current.items()}


def test_a_gone_chunk_rewrites_the_chain() -> None:
    writer, stored = ChainWriter(_key), {}
    current = {f"g{i}": json.dumps(i) for i in range(10)}
    _publish(writer, dict(current), stored)
    stored.clear()  # collected by hand
    current["g10"] = "10"
    stage = _publish(writer, dict(current), stored)
    assert stage.rewritten and len(stage.records) == 1
    assert list(_read(stage, stored)) == list(current)


def test_a_missing_truncated_or_malformed_chunk_is_refused_by_name() -> None:
    writer, stored = ChainWriter(_key), {}
    stage = _publish(writer, {"a": "1", "b": "2"}, stored)
    (key,) = stage.new_files
    with pytest.raises(ChainError, match=f"chunk {key} is missing"):
        read_chain(stage.head(), {}, "test")
    with pytest.raises(ChainError, match=f"chunk {key} is truncated"):
        read_chain(stage.head(), {key: stored[key][:-3]}, "test")
    head = [{**stage.head()[0], "sha256": _sha(b"{]"), "bytes": 2}]
    with pytest.raises(ChainError, match=f"chunk {key} is not valid JSON"):
        read_chain(head, {key: b"{]"}, "test")
    other = b'{"format":"json-chain/9","put":{},"drop":[]}'
    with pytest.raises(ChainError, match="json-chain/9"):
        read_chain([{"key": key, "sha256": _sha(other), "bytes": len(other)}], {key: other}, "t")
    with pytest.raises(ChainError, match="chunk record"):
        read_chain([{"key": key}], stored, "test")


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
