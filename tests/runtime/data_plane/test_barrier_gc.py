"""The exclusive cut defers automatic garbage collection while it is held."""

from __future__ import annotations

import gc

import pytest

from rolloutrun_runtime.data_plane import DataPlaneBarrier


async def test_gc_is_paused_inside_the_cut_and_restored_after() -> None:
    barrier = DataPlaneBarrier()
    assert gc.isenabled()
    async with barrier.checkpoint():
        assert not gc.isenabled()
    assert gc.isenabled()


async def test_a_caller_that_disabled_gc_keeps_it_disabled() -> None:
    barrier = DataPlaneBarrier()
    gc.disable()
    try:
        async with barrier.checkpoint():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


async def test_gc_comes_back_when_the_holder_raises() -> None:
    barrier = DataPlaneBarrier()
    with pytest.raises(RuntimeError, match="capture failed"):
        async with barrier.checkpoint():
            raise RuntimeError("capture failed")
    assert gc.isenabled()


async def test_collection_resumes_only_after_the_cut_is_released(monkeypatch) -> None:
    """The pass the cut deferred may run right after it, but never while mutations wait:
    the barrier is released (and records when) before GC is enabled again."""
    barrier = DataPlaneBarrier()
    claimed_at_enable: list[bool] = []
    enable = gc.enable

    def recording_enable() -> None:
        claimed_at_enable.append(barrier.checkpoint_in_progress)
        enable()

    monkeypatch.setattr(gc, "enable", recording_enable)
    async with barrier.checkpoint() as cut:
        assert cut.released_at is None
    assert claimed_at_enable == [False]
    assert cut.released_at is not None and gc.isenabled()
