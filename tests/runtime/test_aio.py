"""The race behind a lost member's calls (aio.unless_set)."""

from __future__ import annotations

import asyncio

import pytest

from rolloutrun_runtime.aio import EventFirst, unless_set


async def test_a_call_that_ends_first_gives_its_result() -> None:
    async def call() -> str:
        return "answer"

    assert await unless_set(call(), asyncio.Event()) == "answer"


async def test_an_event_set_first_cancels_the_call() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def never_answered() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    lost = asyncio.Event()
    racing = asyncio.ensure_future(unless_set(never_answered(), lost))
    await started.wait()
    lost.set()
    with pytest.raises(EventFirst):
        await racing
    assert cancelled.is_set()


async def test_a_call_that_fails_raises_its_own_error() -> None:
    async def call() -> None:
        raise ConnectionResetError("peer gone")

    with pytest.raises(ConnectionResetError, match="peer gone"):
        await unless_set(call(), asyncio.Event())
