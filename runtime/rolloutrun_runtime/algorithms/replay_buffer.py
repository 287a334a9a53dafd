"""The replay buffer: sealed groups waiting for their train step, and capacity permits.

Why permits: the rollout pump takes one permit per group before it admits a batch and the
train pump gives it back once the group's step is committed (or the group is given up), so
generation can never outrun training by more than ``replayCapacity`` groups. Permits are
taken a whole step at a time and in step order, and a replacement inherits the permit of
the group it replaces, so the groups of the step the trainer waits for always hold permits:
capacity can stall the rollout pump but never deadlock the run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_runtime.cow import CowMap, CowView


class ReplayError(RuntimeError):
    """The replay buffer was asked for something inconsistent."""


@dataclass(frozen=True)
class ReplayGroup:
    """A finalized group: its rows in the data plane's ``train`` partition and its rewards."""

    group_id: str
    prompt_id: int
    target_step: int | None
    row_keys: tuple[str, ...]
    rewards: tuple[float, ...]
    model_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "target_step": self.target_step,
            "row_keys": list(self.row_keys),
            "rewards": list(self.rewards),
            "model_tokens": self.model_tokens,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ReplayGroup:
        return cls(
            group_id=str(data["group_id"]),
            prompt_id=int(data["prompt_id"]),
            target_step=None if data["target_step"] is None else int(data["target_step"]),
            row_keys=tuple(str(k) for k in data["row_keys"]),
            rewards=tuple(float(r) for r in data["rewards"]),
            model_tokens=int(data["model_tokens"]),
        )


@dataclass
class ReplayBuffer:
    """Finalized groups by id (insertion order), plus the capacity semaphore."""

    capacity: int
    #: copy-on-write: a snapshot's cut takes ``view`` in time proportional to the groups
    #: added or taken since its previous one
    _groups: dict[str, ReplayGroup] = field(default_factory=CowMap)
    _permits: asyncio.Semaphore | None = None

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ReplayError("replay capacity must be >= 1")

    # permits are created lazily so the buffer can be built outside a running loop
    @property
    def permits(self) -> asyncio.Semaphore:
        if self._permits is None:
            self._permits = asyncio.Semaphore(self.capacity)
        return self._permits

    async def acquire_permit(self) -> None:
        await self.permits.acquire()

    def release_permit(self, count: int = 1) -> None:
        for _ in range(count):
            self.permits.release()

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def add(self, group: ReplayGroup) -> None:
        if group.group_id in self._groups:
            raise ReplayError(f"group {group.group_id!r} is already in the replay buffer")
        self._groups[group.group_id] = group

    def groups(self) -> list[ReplayGroup]:
        return list(self._groups.values())

    def view(self) -> CowView[str, ReplayGroup]:
        """The groups by id as they are now, in O(groups changed since the previous view);
        the view builds its dict when first read (after a snapshot's cut)."""
        return self._cow().view()

    def prime_view(self) -> None:
        """Ahead of a cut: the next ``view`` costs only what changes from now on."""
        self._cow().prime()

    def _cow(self) -> CowMap[str, ReplayGroup]:
        if not isinstance(self._groups, CowMap):
            self._groups = CowMap(self._groups)
        return self._groups

    def ready_for(self, step: int) -> list[ReplayGroup]:
        """Groups stamped for ``step``, in the order they were finalized."""
        return [g for g in self._groups.values() if g.target_step == step]

    def stale_before(self, step: int) -> list[ReplayGroup]:
        """Groups stamped for a step that has already been trained."""
        return [
            g for g in self._groups.values() if g.target_step is not None and g.target_step < step
        ]

    def take(self, group_ids: list[str]) -> list[ReplayGroup]:
        """Remove and return the named groups (all must be present)."""
        missing = [g for g in group_ids if g not in self._groups]
        if missing:
            raise ReplayError(f"groups {missing} are not in the replay buffer")
        return [self._groups.pop(g) for g in group_ids]

    def put_back(self, groups: list[ReplayGroup]) -> None:
        for group in groups:
            self.add(group)

    def metadata(self) -> list[dict[str, Any]]:
        """The replay view a checkpoint saves beside the data plane."""
        return [g.to_json() for g in self._groups.values()]
