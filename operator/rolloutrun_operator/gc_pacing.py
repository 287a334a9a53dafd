"""Cyclic garbage collection paced for a long-lived watch server (the operator, the local
cluster's API server): no full pass over the whole heap in the middle of a reaction.

Why: at 1,000 runs the operator holds every run's, pod's and Lease's last body (millions of
tracked dicts and lists), and the local cluster's API server holds the objects themselves.
Every watch event adds a new body that survives the young generations, so CPython's
automatic full (generation 2) pass comes every 5-40 s and scans all of it: measured 1.0-1.9 s
in the operator and 1.3-2.5 s in the API server (a ``gc.callbacks`` probe during
``bench/operator_scale.py --runs 1000``). Each stops its process, and they were the losses
whose replacement took 1.6-2.8 s instead of ~0.2 s.

What: every ``freeze_every_s`` the young generations are collected and everything alive is
moved into the permanent generation (``gc.freeze``, the recipe the standard library gives
long-lived servers), so the automatic passes scan only what was allocated since: a few
milliseconds. Frozen objects are still freed by reference counting (a replaced body is
acyclic and goes at once); only a reference cycle that becomes garbage after it was frozen
waits, for the full pass every ``full_every_s`` (unfreeze, collect, freeze), which bounds that
memory and is logged with its duration. Opt-in per process (the ``rolloutrun operator`` and
``rolloutrun cluster`` commands): the freeze is process-wide, so a library user (a test
holding a cluster in its own process) is never frozen behind its back.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, TypeVar

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine
    from typing import Any

logger = logging.getLogger(__name__)

T = TypeVar("T")

Action = Literal["freeze", "full"]


@dataclass(frozen=True)
class GcPacing:
    """How often the live heap is frozen, and how often a full pass collects frozen cycles."""

    freeze_every_s: float = 30.0
    full_every_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0 < self.freeze_every_s <= self.full_every_s:
            raise ValueError(
                f"gc pacing: need 0 < freeze_every_s ({self.freeze_every_s}) <= full_every_s "
                f"({self.full_every_s})"
            )


def next_action(
    pacing: GcPacing, now: float, last_freeze: float, last_full: float
) -> Action | None:
    """What is due at ``now``: a full pass first (it freezes too), then a freeze, else nothing."""
    if now - last_full >= pacing.full_every_s:
        return "full"
    if now - last_freeze >= pacing.freeze_every_s:
        return "freeze"
    return None


def apply(action: Action) -> float:
    """Do ``action`` on this process's collector; the seconds it took."""
    started = time.perf_counter()
    if action == "full":
        gc.unfreeze()
        gc.collect()
    else:
        gc.collect(1)  # the young generations' garbage goes before their survivors are frozen
    gc.freeze()
    return time.perf_counter() - started


async def pace_gc(
    pacing: GcPacing = GcPacing(), *, clock: Callable[[], float] = time.monotonic
) -> None:
    """Pace this process's collector until cancelled (then everything is unfrozen again)."""
    start = clock()
    last_freeze = last_full = start
    tick = min(pacing.freeze_every_s, 5.0)
    try:
        while True:
            await asyncio.sleep(tick)
            now = clock()
            action = next_action(pacing, now, last_freeze, last_full)
            if action is None:
                continue
            took = apply(action)
            last_freeze = now
            if action == "full":
                last_full = now
                logger.info(
                    "full garbage collection: %.3f s, %d objects stay frozen",
                    took,
                    gc.get_freeze_count(),
                )
    finally:
        gc.unfreeze()


async def with_paced_gc(main: Coroutine[Any, Any, T], pacing: GcPacing = GcPacing()) -> T:
    """Run ``main`` with the collector paced beside it (for a command's ``asyncio.run``)."""
    pacer = asyncio.create_task(pace_gc(pacing), name="gc-pacing")
    try:
        return await main
    finally:
        pacer.cancel()
        await asyncio.gather(pacer, return_exceptions=True)
