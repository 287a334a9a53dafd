"""Gym-style environment servers: ``/run`` agent loop, per-episode state, side-effect audit.

``GymServer`` is one replica (an aiohttp app); ``AgentLoop`` is the per-turn state machine
it runs; ``Episode``/``EpisodeId`` are the records the checkpoint control plane exports and
restores; ``tasks`` holds each task's rules and verifier.
"""

from rolloutrun_runtime.environments.gym.agent import (
    AFTER_TOOL,
    BEFORE_MODEL,
    AgentLoop,
    BoundaryHook,
    HttpPolicyClient,
    LocalPolicyClient,
    PolicyCallError,
    PolicyClient,
    SideEffectLog,
    SideEffectReplayError,
    turn_seed,
)
from rolloutrun_runtime.environments.gym.episode import (
    Episode,
    EpisodeId,
    EpisodeRecordError,
    Phase,
    Sampling,
    Segment,
)
from rolloutrun_runtime.environments.gym.server import GymServer
from rolloutrun_runtime.environments.gym.tasks import make_env, score

__all__ = [
    "AFTER_TOOL",
    "BEFORE_MODEL",
    "AgentLoop",
    "BoundaryHook",
    "Episode",
    "EpisodeId",
    "EpisodeRecordError",
    "GymServer",
    "HttpPolicyClient",
    "LocalPolicyClient",
    "Phase",
    "PolicyCallError",
    "PolicyClient",
    "Sampling",
    "Segment",
    "SideEffectLog",
    "SideEffectReplayError",
    "make_env",
    "score",
    "turn_seed",
]
