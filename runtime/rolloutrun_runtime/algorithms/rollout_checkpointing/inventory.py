"""Data-plane inventory checks that saving and restoring both run.

Why both sides: a checkpoint whose rows and references disagree restores into a run that
trains on missing rows (a crash hours later) or leaks rows forever. Saving refuses to write
such a checkpoint; restoring refuses to load one, before anything is installed, so a restore
is never partial. The checks are pure functions over the data plane and the references to it
(the replay view, the steps kept for replay, the ledger's sealed attempts).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    RecoveryLedger,
)


class InventoryError(RuntimeError):
    """Rows a checkpoint references are missing from its data plane."""


@dataclass
class Inventory:
    """What the references expect of each partition, and what is there besides."""

    missing: list[str] = field(default_factory=list)
    orphan_train: list[str] = field(default_factory=list)
    orphan_staging: list[str] = field(default_factory=list)


def expected_train_rows(
    replay_view: Iterable[ReplayGroup], retained_row_keys: Iterable[str]
) -> set[str]:
    """``train`` rows referenced by the replay view and by the steps kept for replay."""
    keys = {key for group in replay_view for key in group.row_keys}
    keys.update(retained_row_keys)
    return keys


def expected_staging_rows(ledger: RecoveryLedger | None) -> set[str]:
    """``staging`` rows referenced by sealed attempts of groups not yet finalized."""
    if ledger is None:
        return set()
    keys = set()
    for group in ledger.unfinished():  # generating or ready to finalize
        for sibling in group.siblings:
            attempt = sibling.current
            if attempt.status is AttemptStatus.SEALED and attempt.row_key:
                keys.add(attempt.row_key)
    return keys


def take_inventory(
    data_plane: DataPlane,
    *,
    replay_view: Iterable[ReplayGroup],
    retained_row_keys: Iterable[str],
    ledger: RecoveryLedger | None,
) -> Inventory:
    """Compare the data plane with everything that references it."""
    return compare_rows(
        data_plane,
        replay_view=replay_view,
        retained_row_keys=retained_row_keys,
        staging_refs=None if ledger is None else expected_staging_rows(ledger),
    )


def compare_rows(
    data_plane: DataPlane,
    *,
    replay_view: Iterable[ReplayGroup],
    retained_row_keys: Iterable[str],
    staging_refs: set[str] | None,
) -> Inventory:
    """:func:`take_inventory` with the ledger's staging references already taken (``None``:
    no ledger), so a capture can take them under its cut and compare after it."""
    train = set(data_plane.list("train"))
    staging = set(data_plane.list("staging"))
    want_train = expected_train_rows(replay_view, retained_row_keys)
    want_staging = staging_refs or set()
    inventory = Inventory(
        missing=sorted(
            [f"train/{key}" for key in want_train - train]
            + [f"staging/{key}" for key in want_staging - staging]
        ),
        orphan_train=sorted(train - want_train),
    )
    # Without the ledger nothing records staged rows: only ledger runs can call them orphans.
    if staging_refs is not None:
        inventory.orphan_staging = sorted(staging - want_staging)
    return inventory


def require_complete(inventory: Inventory, what: str) -> None:
    """Raise :class:`InventoryError` naming the first missing rows."""
    if inventory.missing:
        shown = ", ".join(inventory.missing[:5])
        more = f" and {len(inventory.missing) - 5} more" if len(inventory.missing) > 5 else ""
        raise InventoryError(
            f"{what}: {len(inventory.missing)} referenced rows are missing from the data "
            f"plane ({shown}{more})"
        )
