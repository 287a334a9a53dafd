"""Racing callers: each call in its own thread, all released at once by a barrier, so a test
of an election or a compare-and-swap says only who races and what must come out."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def at_once(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Every call's result, the calls started together (in finishing order)."""
    barrier = threading.Barrier(len(calls))
    results: list[T] = []

    def race(call: Callable[[], T]) -> None:
        barrier.wait()
        results.append(call())

    threads = [threading.Thread(target=race, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results
