"""Await a call unless an event comes first: the one race behind a lost member's calls.

Why one place: a call to a member that is lost mid-call may never be answered (a deleted
pod's address swallows it, a dead node's actor call takes seconds more to fail than the
watch that saw it die). The Gym client's calls, the environment checkpoint's control calls
and a worker's refit each end the call as soon as the member is known lost, by the same
race against an :class:`asyncio.Event`; each side then says what "lost" means for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class EventFirst(Exception):
    """The event was set before the call ended; the call was cancelled."""


async def unless_set(call: Awaitable[T], event: asyncio.Event) -> T:
    """``call``'s result, or :class:`EventFirst` once ``event`` is set before it ends (the
    call is then cancelled; so it is when the caller is)."""
    task = asyncio.ensure_future(call)
    watch = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise EventFirst
    return task.result()
