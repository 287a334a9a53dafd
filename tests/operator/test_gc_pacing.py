"""The operator's and the local cluster's paced collector (gc_pacing): what is due when, that
a freeze keeps the automatic passes off what was alive, and that the full pass still frees a
reference cycle that died frozen."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from rolloutrun_operator.gc_pacing import (
    GcPacing,
    apply,
    next_action,
    pace_gc,
    with_paced_gc,
)


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    """Each test starts and ends with nothing frozen (the freeze is process-wide)."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gc.collect()  # both survive into the oldest generation, as the operator's bodies do
    return weakref.ref(a)


@pytest.mark.parametrize(
    ("now", "last_freeze", "last_full", "expected"),
    [
        (10.0, 0.0, 0.0, None),
        (30.0, 0.0, 0.0, "freeze"),
        (65.0, 40.0, 0.0, None),
        (3600.0, 3590.0, 0.0, "full"),  # the full pass wins over a freeze not yet due
        (7300.0, 7280.0, 3600.0, "full"),
    ],
)
def test_what_is_due(now: float, last_freeze: float, last_full: float, expected: str) -> None:
    assert next_action(GcPacing(), now, last_freeze, last_full) == expected


@pytest.mark.parametrize(("freeze", "full"), [(0.0, 10.0), (-1.0, 10.0), (20.0, 10.0)])
def test_a_pacing_that_cannot_work_is_refused(freeze: float, full: float) -> None:
    with pytest.raises(ValueError, match="gc pacing"):
        GcPacing(freeze_every_s=freeze, full_every_s=full)


def test_a_freeze_keeps_passes_off_the_live_heap_and_the_full_pass_frees_frozen_cycles() -> None:
    alive = _cycle()
    apply("freeze")
    assert gc.get_freeze_count() > 0
    node = alive()
    assert node is not None and node.other is not None
    node.other.other = node  # still a cycle
    del node
    gc.collect()  # a pass does not look at frozen objects: the dead cycle stays
    assert alive() is not None
    apply("full")
    assert alive() is None
    assert gc.get_freeze_count() > 0  # what is alive is frozen again


async def test_the_pacer_freezes_while_it_runs_and_unfreezes_when_cancelled() -> None:
    pacer = asyncio.create_task(pace_gc(GcPacing(freeze_every_s=0.01, full_every_s=0.05)))
    for _ in range(500):
        if gc.get_freeze_count() > 0:
            break
        await asyncio.sleep(0.01)
    assert gc.get_freeze_count() > 0
    pacer.cancel()
    await asyncio.gather(pacer, return_exceptions=True)
    assert gc.get_freeze_count() == 0


async def test_a_command_paced_returns_its_result_and_leaves_nothing_running() -> None:
    async def main() -> str:
        await asyncio.sleep(0.05)
        return "done"

    before = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    assert await with_paced_gc(main(), GcPacing(freeze_every_s=0.01, full_every_s=0.02)) == "done"
    after = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    assert after == before
    assert gc.get_freeze_count() == 0
