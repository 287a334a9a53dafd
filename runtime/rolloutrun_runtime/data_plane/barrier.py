"""The data-plane checkpoint barrier: shared mutation slots and one exclusive checkpoint cut.

Why: a checkpoint must see the data plane, the dataloader cursor, the replay metadata and
the recovery ledger as one state. Every change that touches more than one of them (a
transactional admission, a group commit, a train step's clears) runs inside a
``mutation(kind)`` slot; many slots run at once. ``checkpoint()`` is the exclusive cut: it
stops new slots from starting, waits for the active ones to drain, and while it is held no
slot can start, so whatever the holder reads is consistent. Each completed slot bumps
``mutation_version``, which lets a snapshot pump skip when nothing changed. Automatic
garbage collection is deferred while the cut is held (it runs right after), so a collection
triggered by a capture's allocations never stretches the pumps' pause; a snapshot extends
that deferral over its write (``hold_gc``), so the write's temporaries die by reference
counting instead of triggering a full pass over every buffered record.

Slots hand out a cut object whose ``require_live()`` proves to a mutator (the ledger) that
its caller holds a slot right now. Everything here is asyncio, single event loop: slot
release is synchronous, so a cancelled task never leaks a slot.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

#: The kind under which checkpoint-cut wait times are reported.
CHECKPOINT_KIND = "checkpoint"

_held: contextvars.ContextVar[object | None] = contextvars.ContextVar(
    "rolloutrun_barrier_held", default=None
)


_gc_lock = threading.Lock()
_gc_holds = 0
_gc_was_enabled = False


def acquire_gc_hold() -> None:
    """Defer automatic cyclic GC until every hold is released (holds nest, any thread)."""
    global _gc_holds, _gc_was_enabled
    with _gc_lock:
        if _gc_holds == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holds += 1


def release_gc_hold() -> None:
    """Release one hold; the last one re-enables automatic GC if it was on before."""
    global _gc_holds
    with _gc_lock:
        _gc_holds -= 1
        if _gc_holds == 0 and _gc_was_enabled:
            gc.enable()


@contextmanager
def hold_gc() -> Iterator[None]:
    """``acquire_gc_hold`` for the ``with`` block."""
    acquire_gc_hold()
    try:
        yield
    finally:
        release_gc_hold()


class BarrierError(RuntimeError):
    """The barrier was used in a way that would deadlock or prove nothing."""


class MutationCut:
    """Proof that the holder is inside a shared ``mutation(kind)`` slot."""

    exclusive = False

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.live = True

    def require_live(self) -> None:
        """Raise ``BarrierError`` unless the slot is still held."""
        if not self.live:
            raise BarrierError(f"the {self.kind!r} mutation slot has already been released")


class CheckpointCut:
    """Proof that the holder owns the exclusive checkpoint cut (no mutation is active)."""

    exclusive = True
    kind = CHECKPOINT_KIND

    def __init__(self, mutation_version: int) -> None:
        self.mutation_version = mutation_version
        self.live = True
        #: ``time.monotonic()`` when the cut let mutations in again (None while held).
        self.released_at: float | None = None

    def require_live(self) -> None:
        if not self.live:
            raise BarrierError("the checkpoint cut has already been released")


@dataclass
class WaitStats:
    """How long callers of one kind waited to enter the barrier."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def record(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)


@dataclass
class DataPlaneBarrier:
    """Reader/writer gate: ``mutation(kind)`` shares, ``checkpoint()`` excludes."""

    mutation_version: int = 0
    _active: Counter[str] = field(default_factory=Counter)
    _cut_claimed: bool = False
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)
    _wait_stats: dict[str, WaitStats] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    def active_mutations(self) -> dict[str, int]:
        """Active slots by kind (kinds with none are left out)."""
        return {kind: n for kind, n in self._active.items() if n}

    @property
    def checkpoint_in_progress(self) -> bool:
        """Whether a cut is held or waiting for mutations to drain."""
        return self._cut_claimed

    def wait_telemetry(self) -> dict[str, dict[str, float]]:
        """Per kind: ``count``, ``total_s``, ``max_s`` of waits to enter the barrier."""
        return {
            kind: {"count": s.count, "total_s": s.total_s, "max_s": s.max_s}
            for kind, s in sorted(self._wait_stats.items())
        }

    # ------------------------------------------------------------------ slots
    @asynccontextmanager
    async def mutation(self, kind: str) -> AsyncIterator[MutationCut]:
        """Hold a shared slot counted as ``kind``; waits while a checkpoint cut is claimed."""
        self._refuse_nesting(f"mutation({kind!r})")
        started = time.monotonic()
        await self._wait_until(lambda: not self._cut_claimed)
        self._stats(kind).record(time.monotonic() - started)
        self._active[kind] += 1
        cut = MutationCut(kind)
        token = _held.set(cut)
        try:
            yield cut
        finally:
            _held.reset(token)
            cut.live = False
            self._active[kind] -= 1
            self.mutation_version += 1
            self._wake()

    @asynccontextmanager
    async def checkpoint(self) -> AsyncIterator[CheckpointCut]:
        """Hold the exclusive cut: block new slots, drain active ones, then yield."""
        self._refuse_nesting("checkpoint()")
        started = time.monotonic()
        await self._wait_until(lambda: not self._cut_claimed)
        self._cut_claimed = True
        cut: CheckpointCut | None = None
        held_gc = False
        try:
            await self._wait_until(lambda: not any(self._active.values()))
            self._stats(CHECKPOINT_KIND).record(time.monotonic() - started)
            cut = CheckpointCut(self.mutation_version)
            token = _held.set(cut)
            # Every pump waits while the cut is held, and a capture allocates many small
            # objects: a cyclic-GC pass triggered inside it would hold the pumps for 100+ ms
            # at 1,000 buffered groups. Defer automatic collection until the cut is released.
            acquire_gc_hold()
            held_gc = True
            try:
                yield cut
            finally:
                _held.reset(token)
                cut.live = False
        finally:
            self._cut_claimed = False
            if cut is not None:
                cut.released_at = time.monotonic()
            self._wake()
            # Only now: the collection the capture's allocations are due runs with the
            # mutations already let in, never while they wait.
            if held_gc:
                release_gc_hold()

    # ------------------------------------------------------------------ internals
    def _refuse_nesting(self, what: str) -> None:
        held = _held.get()
        if held is not None and getattr(held, "live", False):
            raise BarrierError(
                f"{what} requested while this task already holds "
                f"{getattr(held, 'kind', 'a cut')!r}: it would deadlock against a checkpoint"
            )

    def _stats(self, kind: str) -> WaitStats:
        return self._wait_stats.setdefault(kind, WaitStats())

    async def _wait_until(self, ready: Callable[[], bool]) -> None:
        loop = asyncio.get_running_loop()
        while not ready():
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
