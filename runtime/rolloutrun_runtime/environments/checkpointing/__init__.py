"""Environment checkpoint backends and the builder that picks one from the run config.

A new backend implements :class:`EnvironmentCheckpoint` in its own module and adds one
branch to :func:`build_environment_checkpoint`; nothing else names a backend.
"""

from __future__ import annotations

from collections.abc import Mapping

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.run_config import RunConfig, TargetLevel
from rolloutrun_runtime.environments.checkpointing.interfaces import (
    EnvironmentCheckpoint,
    EnvironmentCheckpointError,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    EpisodeRestoreOutcome,
    NoEnvironmentCheckpoint,
)


def build_environment_checkpoint(
    config: RunConfig, endpoints: Mapping[str, str], token: str | None, *, incarnation: int = 0
) -> EnvironmentCheckpoint:
    """Gym's control plane for turn-level recovery, else the backend that keeps nothing.

    ``endpoints`` maps each Gym instance id to its base URL; ``token`` is the control token;
    ``incarnation`` is the trainer's (the operator's ``ROLLOUTRUN_INCARNATION``, 0 locally).
    """
    if config.checkpointing.target_level is TargetLevel.TURN:
        from rolloutrun_runtime.environments.checkpointing.nemo_gym import (
            GymEnvironmentCheckpoint,
        )

        if not token:
            raise EnvironmentCheckpointError(
                f"turn-level recovery needs the Gym control token ({ENV_GYM_TOKEN}); none is set"
            )
        return GymEnvironmentCheckpoint(
            endpoints,
            token,
            incarnation=incarnation,
            request_max_bytes=config.gym.request_max_bytes,
        )
    return NoEnvironmentCheckpoint()


__all__ = [
    "EnvironmentCheckpoint",
    "EnvironmentCheckpointError",
    "EnvironmentEpisode",
    "EnvironmentSnapshot",
    "EpisodeRestoreOutcome",
    "NoEnvironmentCheckpoint",
    "build_environment_checkpoint",
]
