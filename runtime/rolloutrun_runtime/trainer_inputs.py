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
- The Gym replicas' instance ids (turn level), which key the environment checkpoint: a
  replica that does not answer at start is down, not the end of the trainer
  (:func:`gym_instance_ids` says how its id is found).

The level and the environment checkpoint are waited for in a task of their own
(:func:`answered_gyms`) while the trainer plans its restore, builds its model and starts its
generation workers, none of which needs them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.contract.run_config import RunConfig, TargetLevel
from rolloutrun_runtime.contract.wire import (
    CHECKPOINT_CONTROL_CAPABILITY,
    HEALTHZ_ROUTE,
    GymHealth,
)
from rolloutrun_runtime.prompt_data import PromptSet, read_prompt_set

if TYPE_CHECKING:
    from rolloutrun_runtime.contract.pod import MemberEndpoint

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
    """The servers among ``urls`` whose ``/healthz`` names no checkpoint control plane.

    A server that does not answer is down, as a Gym lost under a running trainer is: it is
    judged when it (or its replacement, the same image) answers, not here; only when none
    answers is there nothing to judge by, and that is an error naming them."""
    import aiohttp
    import pydantic

    lacking, silent = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            try:
                async with session.get(url.rstrip("/") + HEALTHZ_ROUTE) as response:
                    health = GymHealth.model_validate(await response.json(content_type=None))
            except (aiohttp.ClientError, TimeoutError, ValueError, pydantic.ValidationError) as e:
                silent.append(f"environment server {url} did not answer {HEALTHZ_ROUTE}: {e}")
                continue
            if CHECKPOINT_CONTROL_CAPABILITY not in health.capabilities:
                lacking.append(url)
    if len(silent) == len(urls):
        raise RuntimeError("; ".join(silent))
    for why in silent:
        logger.warning("%s (down: judged when it answers)", why)
    return lacking


#: Seconds between probes of a Gym replica the trainer waits for at start.
PROBE_PERIOD_S = 0.2


async def gym_instance_ids(
    urls: list[str],
    *,
    pod_ids: Callable[[int], str] | None = None,
    budget_s: float = 0.0,
    members: Callable[[bool], Mapping[int, MemberEndpoint]] | None = None,
) -> dict[str, str]:
    """``{instance_id: url}`` from each Gym replica's ``/healthz`` (turn level).

    A replica that does not answer is down, not the end of the trainer (issue 14):

    - In a pod (``pod_ids``: the operator's ``gym_instance_id(run, index)``, the id every
      generation of replica ``index`` is started with) its id is derived, once every replica
      that answered reports exactly its derived id (the rule is checked, not assumed). Its
      episodes then take a lost replica's path (the restore skips it, the Gym client
      re-admits its replacement and readdresses the checkpoint to it).
    - Elsewhere (static endpoints from the launcher or the user) nothing names its id, and
      a guessed one would send a restored episode to a replica that does not own it: it is
      waited for (re-probed, at the address ``members`` announces if any), at most
      ``budget_s`` (``rollout.gymUnreachableSeconds``, as long as the Gym client waits
      for a lost one), then ``GymOutageError`` names it: a restart is the only safe way on.
    """
    import aiohttp

    from rolloutrun_runtime.algorithms.gym_outages import GymOutageError

    answered: dict[int, tuple[str, str]] = {}  # index -> (instance id, url)
    silent: dict[int, str] = {}  # index -> why
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            # Asked only once one is silent: a pod's read is an API call at start-up.
            known = await asyncio.to_thread(members, True) if members and silent else {}
            for index, listed in enumerate(urls):
                if index in answered:
                    continue
                url = known[index].url if index in known else listed
                instance, why = await _reported_id(session, url)
                if instance is not None:
                    answered[index] = (instance, url)
                    silent.pop(index, None)
                else:
                    silent[index] = why
            derived = _derived_ids(answered, silent, pod_ids)
            if derived is not None:
                for index, instance in derived.items():
                    logger.warning(
                        "Gym replica %s (%s) opens as down: %s", index, instance, silent[index]
                    )
                    answered[index] = (instance, urls[index])
                break
            waited = time.monotonic() - started
            if not silent:
                break
            if waited >= budget_s:
                raise GymOutageError(
                    f"turn level: no id for Gym replica(s) that did not answer within "
                    f"{waited:.1f}s (rollout.gymUnreachableSeconds {budget_s:g}): "
                    + "; ".join(silent[i] for i in sorted(silent))
                )
            await asyncio.sleep(PROBE_PERIOD_S)
    return _distinct(answered)


def _derived_ids(
    answered: Mapping[int, tuple[str, str]],
    silent: Mapping[int, str],
    pod_ids: Callable[[int], str] | None,
) -> dict[int, str] | None:
    """The silent replicas' derived ids, or None when there is none to derive (nothing
    silent, not a pod, or an answering replica's id is not its derived one)."""
    if not silent or pod_ids is None:
        return None
    if any(instance != pod_ids(index) for index, (instance, _) in answered.items()):
        return None
    return {index: pod_ids(index) for index in silent}


def _distinct(answered: Mapping[int, tuple[str, str]]) -> dict[str, str]:
    found: dict[str, str] = {}
    for _, (instance, url) in sorted(answered.items()):
        if instance in found:
            raise RuntimeError(
                f"Gym replicas {found[instance]} and {url} both call themselves {instance!r}"
            )
        found[instance] = url
    return found


async def _reported_id(session: Any, url: str) -> tuple[str | None, str]:
    """The id ``url``'s ``/healthz`` reports, or None and why it did not answer. A replica
    that answers without a valid id is a misconfiguration, not an outage: it raises."""
    import aiohttp
    import pydantic

    try:
        async with session.get(url.rstrip("/") + HEALTHZ_ROUTE) as response:
            body = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as error:
        return None, f"Gym replica {url} did not answer {HEALTHZ_ROUTE}: {error}"
    try:
        instance = GymHealth.model_validate(body).instance_id
    except pydantic.ValidationError as error:
        raise RuntimeError(
            f"Gym replica {url} answered {HEALTHZ_ROUTE} without a valid instance_id: "
            f"{error.errors()[0]['msg']}"
        ) from None
    if not instance:
        raise RuntimeError(f"Gym replica {url} reported no instance_id on {HEALTHZ_ROUTE}")
    return str(instance), ""


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


async def answered_gyms(
    cfg: RunConfig,
    trace: Any,
    gym_token: str | None,
    gym_members: Callable[[bool], Mapping[int, MemberEndpoint]] | None,
) -> tuple[RunConfig, Any]:
    """The run's settled recovery level (turn level needs the Gyms' checkpoint control
    plane; without it the run recovers at sibling level and says so in the trace) and its
    environment checkpoint, once the Gyms answer.

    Why a task beside the rest of start-up: where the Gyms start with the trainer (a new
    run, a node lost with all its pods) waiting for them took the trainer's start from
    restore planning, model building and the workers' start (a Ray cluster's, seconds), which
    none of them needs: the restore's plan reads only what the level cannot change (it lowers
    turn to sibling, never to none: the ledger is read either way), and the model and the
    workers depend on neither."""
    cfg, level_note = await with_recovery_level(cfg)  # turn needs the control plane
    if level_note is not None:
        level = cfg.checkpointing.target_level.value
        trace.emit("recovery_level_lowered", requested="turn", level=level, reason=level_note)
    return cfg, await _environment_checkpoint(cfg, gym_token, gym_members)


async def close_answered_gyms(answered: asyncio.Task[tuple[RunConfig, Any]]) -> None:
    """The environment checkpoint :func:`answered_gyms` built closed, or its wait ended
    (start-up failed before the Gyms answered)."""
    if not answered.done():
        answered.cancel()
        await asyncio.wait({answered})
    if answered.cancelled() or answered.exception() is not None:
        return
    _cfg, environment = answered.result()
    await environment.close()


async def _environment_checkpoint(
    cfg: RunConfig,
    gym_token: str | None,
    gym_members: Callable[[bool], Mapping[int, MemberEndpoint]] | None = None,
) -> Any:
    """The environment's checkpoint participant, keyed by each Gym replica's instance id.

    A restored episode must go back to the replica that owns it, and the ledger records the
    id each replica reports (``gym-<i>`` from the launcher, ``<run>-gym-<k>`` in pods), so
    the ids come from the replicas' ``/healthz``, never from their order; a replica that
    does not answer is keyed as :func:`gym_instance_ids` decides (in a pod its id is
    derived; elsewhere it is waited for). ``gym_token``: the run's token, as
    :func:`~rolloutrun_runtime.trainer.run_trainer` resolved it.
    """
    from rolloutrun_runtime.contract.pod import ENV_INCARNATION, ENV_RUN_NAME, gym_instance_id
    from rolloutrun_runtime.environments.checkpointing import build_environment_checkpoint

    endpoints = {f"gym-{i}": url for i, url in enumerate(cfg.gym.endpoints)}
    if cfg.checkpointing.target_level is TargetLevel.TURN:
        run = os.environ.get(ENV_RUN_NAME)  # set in pods: the operator's RolloutRun name
        endpoints = await gym_instance_ids(
            list(cfg.gym.endpoints),
            pod_ids=(lambda index: gym_instance_id(run, index)) if run else None,
            budget_s=cfg.rollout.gym_unreachable_seconds,
            members=gym_members,
        )
    return build_environment_checkpoint(
        cfg,
        endpoints,
        gym_token,
        incarnation=int(os.environ.get(ENV_INCARNATION, "0") or 0),
    )
