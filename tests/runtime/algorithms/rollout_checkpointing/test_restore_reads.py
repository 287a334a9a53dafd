"""A resume reads each stored object of the entry it restores once (start-up time: a trainer
pod goes from launch to its first redispatch without reading its snapshot twice)."""

from __future__ import annotations

from collections import Counter

from rolloutrun_runtime.storage.base import CheckpointStorage
from tests.support.rollout_checkpoints import harness, tiny_config, two_snapshots


async def test_a_resume_reads_each_object_once(tmp_path, monkeypatch) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 2}))
        await two_snapshots(h, cfg)
        second = await h.controller(cfg)
        reads: Counter[str] = Counter()
        storage_type = type(second.manifests.storage)  # the real backend of this run
        read_bytes = storage_type.read_bytes

        def counting(self: CheckpointStorage, key: str) -> bytes:
            reads[key] += 1
            return read_bytes(self, key)

        monkeypatch.setattr(storage_type, "read_bytes", counting)
        restored = await second.restore()
        assert restored is not None and restored.snapshot_id is not None
        assert reads, "the resume read its entry"
        assert {key: n for key, n in reads.items() if n > 1} == {}


async def test_a_resume_reads_its_entry_concurrently(tmp_path, monkeypatch) -> None:
    """The chosen snapshot's files and its anchor are read at once, not one round trip after
    another (on ``gs://`` each is a round trip before the first redispatch). Each read waits
    (at most a second) for a second read to be in flight; read one after another, none is."""
    import threading

    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 2}))
        await two_snapshots(h, cfg)
        second = await h.controller(cfg)
        storage_type = type(second.manifests.storage)
        read_bytes = storage_type.read_bytes
        seen = threading.Condition()
        flight = {"now": 0, "peak": 0}

        def overlapping(self: CheckpointStorage, key: str) -> bytes:
            with seen:
                flight["now"] += 1
                flight["peak"] = max(flight["peak"], flight["now"])
                seen.notify_all()
                seen.wait_for(lambda: flight["peak"] >= 2, timeout=1.0)
            try:
                return read_bytes(self, key)
            finally:
                with seen:
                    flight["now"] -= 1

        monkeypatch.setattr(storage_type, "read_bytes", overlapping)
        restored = await second.restore()
        assert restored is not None and restored.snapshot_id is not None
        assert flight["peak"] >= 2
