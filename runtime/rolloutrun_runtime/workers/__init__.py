"""Policy workers: where the generation servers run, behind one small protocol.

Why a protocol with two backends: in pods the generation servers run as Ray actors (the
default; ``ray.init`` locally or join ``workers.rayAddress``), the way NeMo-RL places vLLM
workers, while fast tests and tiny runs want them on the trainer's own event loop. The
trainer (the caller) only needs the endpoints to hand to the Gym, and ``refit`` after every
optimizer step; which backend runs them is a config choice.

``refit`` copies the weights before it returns, so the caller may change its parameters
again as soon as the call completes (not before).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # the config models only when workers are built: a worker pod's entry
    # point (:mod:`.ray_node`) is in this package and needs none of them
    import torch

    from rolloutrun_runtime.contract.run_config import RunConfig


@runtime_checkable
class PolicyWorkers(Protocol):
    """Generation servers the trainer refits; ``endpoints`` are their base URLs."""

    endpoints: list[str]

    async def start(self) -> None:
        """Start every server; ``endpoints`` is filled when this returns."""
        ...

    async def refit(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Install weights ``version`` on every server (running calls continue on it)."""
        ...

    async def stop(self) -> None:
        """Stop every server; safe to call twice."""
        ...


@runtime_checkable
class SharesTrainerLoop(Protocol):
    """Workers whose engines decode on the trainer's own event loop and interpreter (the
    in-process backend): ``until_idle`` waits (at most ``timeout_s``) for a moment when no
    call has decoded for ``quiet_s``, so the trainer's own bursts of work (a snapshot's
    commit, cut and write) do not hold back a decode step. Workers in other processes (Ray)
    share neither."""

    async def until_idle(self, timeout_s: float, quiet_s: float = 0.0) -> bool:
        """True if every engine is idle on return."""
        ...


#: How the trainer's log says what became of the standby pool (read by the worker bench and
#: the e2e tests to follow the pool from outside): a standby started (its address and the
#: pool's size follow), one admitted in a lost worker's place (``generation worker <i>``
#: before, its address after), one lost.
STANDBY_STARTED_LOG = "standby generation worker started at"
STANDBY_ADMITTED_LOG = ": standby at "
STANDBY_LOST_LOG = "standby generation worker lost"


class WorkerError(RuntimeError):
    """A worker backend failed to start, refit or stop."""


def build_workers(
    cfg: RunConfig,
    state_dict: dict[str, torch.Tensor],
    version: int,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
) -> PolicyWorkers:
    """The backend ``cfg.workers.backend`` names, serving ``state_dict`` as ``version``.

    ``host``/``port``: where the generation servers listen (in a pod: ``$POD_IP`` and the
    generation port, for the first server; the others take free ports). Ray workers that
    join a cluster (``workers.rayAddress``) listen on every interface instead. ``token``:
    the run's data-plane token the servers require (None: ``ENV_GYM_TOKEN``)."""
    from rolloutrun_runtime.contract.run_config import WorkerBackend

    if cfg.workers.backend is WorkerBackend.INPROCESS:
        from rolloutrun_runtime.workers.inprocess import InProcessWorkers

        return InProcessWorkers(cfg, state_dict, version, host=host, port=port, token=token)
    if cfg.workers.backend is WorkerBackend.RAY:
        from rolloutrun_runtime.workers.ray_workers import RayWorkers

        return RayWorkers(cfg, state_dict, version, host=host, port=port, token=token)
    raise WorkerError(f"unknown worker backend {cfg.workers.backend!r}")


__all__ = [
    "STANDBY_ADMITTED_LOG",
    "STANDBY_LOST_LOG",
    "STANDBY_STARTED_LOG",
    "PolicyWorkers",
    "WorkerError",
    "build_workers",
]
