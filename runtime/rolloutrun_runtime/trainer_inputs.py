"""What the trainer settles from outside its config: the prompt set and the recovery level.

Why apart from ``trainer.py``: both facts come from outside the config (a file in a bucket,
the environment servers' ``/healthz``), and both change the config the rest of the trainer
sees, so they are decided once, here, on a copy (the prompt set first of all, the level
right before the environment checkpoint is built):

- ``task.dataset``: the prompt file is read once and held (:mod:`rolloutrun_runtime.prompt_data`);
  its row count becomes ``task.datasetSize``, so the dataloader's permutation, its cursor
  state (which names the size and refuses another) and the audit work as with the built-in
  tasks.
- ``checkpointing.targetLevel: turn`` needs every environment server to serve the
  checkpoint control plane. A server that does not name
  :data:`~rolloutrun_runtime.contract.wire.CHECKPOINT_CONTROL_CAPABILITY` in its
  ``/healthz`` answer (the user's own server may leave it out: it is optional in
  docs/environment-contract.md) makes the run recover at sibling level instead, and the
  trainer says so (a warning naming the server, a ``recovery_level_lowered`` trace event,
  and ``recovery_level`` in its result).
"""

from __future__ import annotations

import logging

from rolloutrun_runtime.contract.run_config import RunConfig, TargetLevel
from rolloutrun_runtime.contract.wire import (
    CHECKPOINT_CONTROL_CAPABILITY,
    HEALTHZ_ROUTE,
    GymHealth,
)
from rolloutrun_runtime.prompt_data import PromptSet, read_prompt_set

logger = logging.getLogger(__name__)


def recovery_level(requested: TargetLevel, lacking: list[str]) -> tuple[TargetLevel, str | None]:
    """The level a run recovers at when the servers in ``lacking`` have no control plane."""
    if requested is not TargetLevel.TURN or not lacking:
        return requested, None
    return TargetLevel.SIBLING, (
        f"checkpointing.targetLevel turn needs the checkpoint control plane, and environment "
        f"server(s) {', '.join(lacking)} do not serve it ({HEALTHZ_ROUTE} names no "
        f"{CHECKPOINT_CONTROL_CAPABILITY!r} capability): this run recovers at sibling level "
        "(unfinished episodes restart from turn 0)"
    )


async def lacking_control_plane(urls: list[str]) -> list[str]:
    """The servers among ``urls`` whose ``/healthz`` names no checkpoint control plane."""
    import aiohttp
    import pydantic

    lacking = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            try:
                async with session.get(url.rstrip("/") + HEALTHZ_ROUTE) as response:
                    health = GymHealth.model_validate(await response.json(content_type=None))
            except (aiohttp.ClientError, TimeoutError, ValueError, pydantic.ValidationError) as e:
                raise RuntimeError(
                    f"environment server {url} did not answer {HEALTHZ_ROUTE}: {e}"
                ) from e
            if CHECKPOINT_CONTROL_CAPABILITY not in health.capabilities:
                lacking.append(url)
    return lacking


def with_prompt_set(cfg: RunConfig) -> tuple[RunConfig, PromptSet | None]:
    """A copy of ``cfg`` sized to its prompt set, and the set (None without ``task.dataset``).

    Read first, before anything is built: a bad file fails the start naming itself."""
    if cfg.task.dataset is None:
        return cfg, None
    prompts = read_prompt_set(cfg.task.dataset, cfg.resolved_storage_uri())
    cfg = cfg.model_copy(deep=True)
    cfg.task.dataset_size = len(prompts)
    logger.info("prompt set %s: %d prompts", prompts.source, len(prompts))
    return cfg, prompts


async def with_recovery_level(cfg: RunConfig) -> tuple[RunConfig, str | None]:
    """A copy of ``cfg`` at the level its environment servers allow, and why it changed.

    Asked right before the environment checkpoint is built, when the trainer first needs
    the servers (as the turn-level instance ids are)."""
    if cfg.checkpointing.target_level is not TargetLevel.TURN or not cfg.gym.endpoints:
        return cfg, None
    lacking = await lacking_control_plane(list(cfg.gym.endpoints))
    level, note = recovery_level(TargetLevel.TURN, lacking)
    if note is None:
        return cfg, None
    logger.warning(note)
    cfg = cfg.model_copy(deep=True)
    cfg.checkpointing.target_level = level
    return cfg, note
