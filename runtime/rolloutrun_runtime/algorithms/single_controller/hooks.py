"""What a run tells the process around it, and the one question it asks: the run hooks.

Why a protocol: the trainer pod (lease fencing and progress annotations), the local
launcher (a progress line) and the tests each want a few of the same five moments. They
pass one hooks object to ``run_trainer``, which hands it to the controller, which hands the
snapshot moments to the snapshotter; nobody threads five loose callbacks through three
layers. ``NoHooks`` is the default and the base to override selectively.

The moments:

- ``fence()`` right before a trainer checkpoint or a snapshot manifest is committed; it
  raises to refuse the commit (a trainer whose lease was taken over never commits);
- ``on_step(record)`` after each train step, with its metrics record;
- ``on_anchor(step)`` after each committed trainer checkpoint ``step_<N>``;
- ``on_published(published)`` after each published snapshot manifest;
- ``on_snapshot(record)`` after each snapshot attempt, published or skipped.

Who calls them: the train pump ``on_step``; the trainer checkpoints ``fence`` before a
publish; the snapshotter ``fence``, ``on_published`` and ``on_snapshot``. ``run_trainer``
also wires ``fence`` and ``on_anchor`` into its trainer checkpointer
(``pod.fenced_checkpointer``), which asks the fence again right before the ``step_<N>``
marker and reports the anchor once it is written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class RunHooks(Protocol):
    def fence(self) -> None: ...

    def on_step(self, record: dict[str, Any]) -> None: ...

    def on_anchor(self, step: int) -> None: ...

    def on_published(self, published: dict[str, Any]) -> None: ...

    def on_snapshot(self, record: dict[str, Any]) -> None: ...


class NoHooks:
    """Every hook a no-op: nothing fenced, nothing reported."""

    def fence(self) -> None:
        return None

    def on_step(self, record: dict[str, Any]) -> None:
        return None

    def on_anchor(self, step: int) -> None:
        return None

    def on_published(self, published: dict[str, Any]) -> None:
        return None

    def on_snapshot(self, record: dict[str, Any]) -> None:
        return None


class OnStep(NoHooks):
    """Only each step's record (the local launcher's progress line, tests)."""

    def __init__(self, on_step: Callable[[dict[str, Any]], None]) -> None:
        self._on_step = on_step

    def on_step(self, record: dict[str, Any]) -> None:
        self._on_step(record)
