"""Trainer checkpoints: capture ``step_<N>`` under the cut, serialize it off the loop, publish.

Why its own part: a trainer checkpoint is the anchor every snapshot and every restore
builds on, and its three phases each need a different lock. The capture takes the save
lock (shared with the snapshotter, so the two never interleave) and then the barrier's
exclusive cut (``barrier.checkpoint()``), and copies the weights, the optimizer, the RNG and
the rollout state (the snapshotter's ``capture``); serializing runs in a thread outside
the cut; publishing (fenced by ``hooks.fence``) commits ``step_<N>``, and only then, under
one ``anchor_advances`` mutation, releases the rows kept for replay up to N. With
``deferFinalize`` the publish waits for the next step boundary (``finalize_deferred``).

The train pump calls ``save`` every ``savePeriod`` steps and ``finalize_deferred`` at each
step boundary; the controller calls both once more at the end of the run.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    ManifestStore,
    rollout_config_view,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CapturedRolloutState,
    CaptureKind,
)
from rolloutrun_runtime.algorithms.single_controller.hooks import RunHooks
from rolloutrun_runtime.algorithms.single_controller.run_state import RunState
from rolloutrun_runtime.algorithms.trainer_checkpoint import (
    CheckpointClashError,
    TrainerCapture,
    TrainerCheckpointer,
)
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.experience.rollout_recovery import LiveCut

logger = logging.getLogger(__name__)


class TrainerCheckpoints:
    """Saves and publishes the run's trainer checkpoints (nothing without a checkpointer)."""

    def __init__(
        self,
        state: RunState,
        *,
        checkpointer: TrainerCheckpointer | None,
        manifests: ManifestStore | None,
        snapshots: RolloutSnapshotter,
        hooks: RunHooks,
    ) -> None:
        self.state = state
        self.checkpointer = checkpointer
        self.manifests = manifests
        self.snapshots = snapshots
        self.hooks = hooks
        self._deferred: tuple[int, asyncio.Task[dict[str, bytes]]] | None = None

    @property
    def enabled(self) -> bool:
        return self.checkpointer is not None

    def capture(self, cut: LiveCut) -> tuple[TrainerCapture, CapturedRolloutState]:
        """In-memory copies of everything a trainer checkpoint saves (call under the cut)."""
        state = self.state
        captured = self.snapshots.capture(cut, CaptureKind.TRAINER_CHECKPOINT)
        trainer_state: dict[str, Any] = {
            **captured.controller_state,
            # the view the fingerprint hashes, so a resume after an upgrade that added a
            # defaulted field can tell that field from a real change (resume_config_differences)
            "config_view": rollout_config_view(state.cfg),
            "training_info": {
                "groups_trained": len(state.groups_trained),
                "last_step": state.history[-1] if state.history else None,
            },
        }
        capture = TrainerCapture.take(
            state.trainer_version, state.model, state.optimizer, trainer_state
        )
        return capture, captured

    async def save(self, *, defer: bool | None = None) -> None:
        """Save ``step_<N>`` for the current version (deferred finalize if configured)."""
        defer = self.state.cfg.checkpointing.defer_finalize if defer is None else defer
        async with self.state.save_lock:
            async with self.state.barrier.checkpoint() as cut:
                capture, captured = self.capture(cut)

            def serialize() -> dict[str, bytes]:
                # The sidecars first: they settle the ledger's checksum facts (computed after
                # the cut), which the trainer state records too.
                sidecars = RolloutSnapshotter.write_controller_sidecars(captured)
                if "rollout_recovery" in captured.controller_state:
                    capture.trainer_state["rollout_recovery"] = captured.controller_state[
                        "rollout_recovery"
                    ]
                files = capture.to_files()
                files.update(sidecars)
                return files

            task = asyncio.create_task(asyncio.to_thread(serialize))
            if defer:
                self._deferred = (capture.step, task)
                return
            await self._publish(capture.step, await task)

    async def _publish(self, step: int, files: dict[str, bytes]) -> None:
        """Commit ``step_<N>`` (fenced), then release the rows kept for replay up to N."""
        assert self.checkpointer is not None
        state = self.state
        # Off the loop: a pod's fence reads the Lease from the API server (a round trip that
        # waits behind the keeper's other calls), and the pumps and Gym calls go on meanwhile.
        await asyncio.to_thread(self.hooks.fence)
        crash_point("during_trainer_checkpoint_finalize")
        try:
            uri = await asyncio.to_thread(self.checkpointer.publish_files, step, files)
        except CheckpointClashError as error:
            # Another trajectory's weights hold step_<N>: never anchor to them. The run goes
            # on anchored to its last own step (snapshots keep the groups since) and the next
            # trainer checkpoint anchors it again; see trainer_checkpoint.
            logger.error("trainer checkpoint not anchored: %s", error)
            return
        state.durable_step = step
        async with state.barrier.mutation("anchor_advances"):
            released = state.runtime_state.advance_replay_anchor(step)
            state.data_plane.clear("train", released)
        logger.debug("trainer checkpoint %s is durable", uri)
        # ``on_published`` reports snapshot manifests (the snapshotter calls it); the
        # checkpointer itself reports trainer anchors.
        self.snapshots.trainer_checkpoint_published(step)

    async def finalize_deferred(self) -> None:
        """Publish a deferred trainer checkpoint (at a step boundary, or at the end)."""
        if self._deferred is None:
            return
        step, task = self._deferred
        self._deferred = None
        async with self.state.save_lock:
            await self._publish(step, await task)
