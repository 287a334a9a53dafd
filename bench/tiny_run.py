"""The tiny run every part of ``bench.rollout_checkpoint`` measures (:data:`TINY`).

Why its own module: ``bench.rollout_checkpoint.main`` adjusts this one dict before any part
runs (``--quick``'s steps and ``savePeriod``, ``--target-level``), and the pause part
(:mod:`bench.snapshot_pause`) builds its controller from it as the kill and throughput runs
write their configs from it. Both must read the same object, also when
``bench.rollout_checkpoint`` runs as ``__main__`` (``python -m`` or as a file), where importing
it by name would load a second, unadjusted copy.
"""

from __future__ import annotations

from typing import Any

#: A multi-turn run (4 turns of 100 ms environment time; a step takes about 0.5 s on 2 cores),
#: so ``savePeriod: 10`` spans several seconds and snapshots fall between trainer checkpoints
#: as they do in real runs.
TINY: dict[str, Any] = {
    "seed": 3,
    "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 64},
    "task": {
        "name": "reach_target",
        "datasetSize": 64,
        "maxOperand": 9,
        "maxTurns": 4,
        "maxNewTokens": 3,
        "turnDelayMs": 100,
    },
    "grpo": {
        "groupSize": 4,
        "promptsPerStep": 4,
        "maxSteps": 40,
        "learningRate": 0.003,
        "maxStaleness": 1,
    },
    "rollout": {"maxInFlightGroups": 8},
    "checkpointing": {
        "savePeriod": 10,
        "snapshotIntervalSeconds": 1,
        "targetLevel": "turn",
        "deterministic": True,
    },
    "gym": {"replicas": 1},
    "workers": {"backend": "inprocess"},
}
