"""The snapshot writer: one background thread, at a lower CPU priority, for a snapshot's
serialization and publication.

Why: with a snapshot after every train step, the write (sidecars, data plane) and the
publish (files, fsyncs, manifest, LATEST, retention) run while the same process generates
and trains. On the loop's default executor they ran at the trainer's priority, beside the
train step's own thread, and took the cores (and, in their Python stretches, the GIL) from
the generation the next step waits for. On Linux a nice value belongs to a thread, so this
writer's one thread runs at ``WRITER_NICE`` above the process: when the cores are busy the
scheduler serves the trainer's threads first; when they idle it runs at once. One thread
also keeps one snapshot's files from interleaving with another's writes.

Durability does not change: the same bytes, the same fsyncs, the manifest last; only when
the CPU runs them. An urgent attempt (a forced one: the preemption snapshot inside its
grace period) does not wait behind the background priority: ``run`` takes ``urgent`` and
uses the default executor at the process's priority.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import os
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: How much nicer than the process the writer thread runs (0-19; Linux only).
WRITER_NICE = 10


def lower_thread_priority(increment: int = WRITER_NICE) -> int | None:
    """Raise the calling thread's nice value by ``increment`` (Linux: per thread); returns
    the new value, or None where a thread cannot have its own (the call is then a no-op)."""
    if not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return None
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + increment))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as error:  # a sandbox without setpriority: run at the process's priority
        logger.debug("snapshot writer keeps its priority: %s", error)
        return None


class SnapshotWriter:
    """Runs a snapshot's blocking work on its own low-priority thread (created on first use)."""

    def __init__(self, nice: int = WRITER_NICE) -> None:
        self._nice = nice
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.thread_nice: int | None = None
        """The writer thread's nice value once it started (None: not lowered)."""

    def _started(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="snapshot-writer", initializer=self._init
            )
        return self._executor

    def _init(self) -> None:
        self.thread_nice = lower_thread_priority(self._nice)

    async def run(self, fn: Callable[..., T], *args: object, urgent: bool = False) -> T:
        """``fn(*args)`` off the loop (with the caller's context, as ``asyncio.to_thread``):
        on the writer thread, or with ``urgent`` on the default executor."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        executor = None if urgent else self._started()
        return await asyncio.get_running_loop().run_in_executor(executor, call)

    def close(self) -> None:
        """Let the thread end (after the work already handed to it)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
