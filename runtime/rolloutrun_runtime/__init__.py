"""rolloutrun's in-pod runtime: trainer, Gym environment servers and rollout checkpointing.

Everything that runs inside the trainer and Gym pods (and in local mode) lives here. The
operator talks to this package only through :mod:`rolloutrun_runtime.contract`.
"""

__version__ = "0.1.0"
