"""Copy-on-write views a capture takes under the exclusive cut, read after it.

Why apart from :mod:`.state`: the cut takes each large part of the rollout state (the replay
buffer, the finalizer results) as a :class:`~rolloutrun_runtime.cow.CowView`, in time
proportional to what changed since the previous capture; these wrappers give the writer the
sequences it reads, built from the views when first read, after the cut and off the loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.cow import CowMap, CowView

if TYPE_CHECKING:
    from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
        FinalizerResult,
        RolloutParts,
    )


class CapturedReplayView(Sequence[ReplayGroup]):
    """The replay view at a cut: the buffer's copy-on-write view (taken in time proportional
    to the groups changed since the previous capture), then the open step's groups; the
    list is built when first read, after the cut."""

    def __init__(self, buffered: CowView[str, ReplayGroup], open_step: Sequence[ReplayGroup]):
        self._buffered = buffered
        self._open_step = tuple(open_step)

    @property
    def changed(self) -> int:
        """Buffered groups added or taken since the previous view (0: copied whole)."""
        return self._buffered.changed

    @cached_property
    def _groups(self) -> list[ReplayGroup]:
        return [*self._buffered.mapping().values(), *self._open_step]

    def __len__(self) -> int:
        return len(self._groups)

    def __getitem__(self, index: Any) -> Any:
        return self._groups[index]

    def __iter__(self) -> Iterator[ReplayGroup]:
        return iter(self._groups)


class CapturedResults:
    """``runtime_state["finalizer_results"]`` at a cut: a copy-on-write view of the results
    by group (never mutated); iterating builds it, after the cut."""

    def __init__(self, view: CowView[str, FinalizerResult]) -> None:
        self._view = view

    @property
    def changed(self) -> int:
        """Results added or dropped since the previous view (0: copied whole)."""
        return self._view.changed

    def __iter__(self) -> Iterator[FinalizerResult]:
        return iter(self._view.mapping().values())

    def __len__(self) -> int:
        return len(self._view.mapping())


def cow_view(values: Mapping[Any, Any]) -> CowView[Any, Any]:
    """A copy-on-write view of ``values`` (a whole copy unless it is a :class:`CowMap`)."""
    return values.view() if isinstance(values, CowMap) else CowView(full=dict(values))


def prime_views(parts: RolloutParts) -> None:
    """Ahead of the cut, on the loop: a part never captured (or whose change log outgrew
    it) is copied whole now, so the cut takes only what changes from here on."""
    parts.buffer.prime_view()
    parts.data_plane.prime_copies()
    if parts.ledger is not None:
        parts.ledger.prime_capture()
    results = parts.runtime_state.finalizer_results
    if not isinstance(results, CowMap):  # a state filled by hand: log from now on
        results = parts.runtime_state.finalizer_results = CowMap(results)
    results.prime()
