"""The data plane: the seed's TQ stand-in (a partitioned row store) and its checkpoint barrier.

Training rows and staged rollout results live here between the pumps; the barrier is what
lets a checkpoint see the store, the dataloader cursor, the replay metadata and the recovery
ledger as one consistent cut.
"""

from rolloutrun_runtime.data_plane.barrier import (
    BarrierError,
    CheckpointCut,
    DataPlaneBarrier,
    MutationCut,
    hold_gc,
)
from rolloutrun_runtime.data_plane.store import (
    PARTITIONS,
    DataPlane,
    DataPlaneCopy,
    DataPlaneError,
    RowNotFoundError,
)

__all__ = [
    "PARTITIONS",
    "BarrierError",
    "CheckpointCut",
    "DataPlane",
    "DataPlaneBarrier",
    "DataPlaneCopy",
    "DataPlaneError",
    "MutationCut",
    "RowNotFoundError",
    "hold_gc",
]
