"""The trainer pod's entry point: ``rolloutrun trainer --config FILE [--log-dir DIR]``.

Why a separate module from the controller: the pod entry point owns the process-level
choices (threads, seeds, storage, worker backend, resume from the newest committed
``step_<N>``, the final-weights digest) and the controller stays a pure asyncio object that
tests build directly. ``rolloutrun train`` (the local launcher) calls ``run_trainer`` in its
own process after starting the Gym replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.contract.layout import SNAPSHOTS_LOG, TRACE_FILE
from rolloutrun_runtime.contract.pod import lease_duration_from
from rolloutrun_runtime.metrics import STARTUP
from rolloutrun_runtime.pod import (
    EXIT_FENCED,
    PodLease,
    fenced_checkpointer,
    generation_address,
    resolve_config_path,
    take_gym_token,
    take_metrics_token,
)
from rolloutrun_runtime.trainer_observe import Observation

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import ResumeChoice
    from rolloutrun_runtime.algorithms.single_controller import RunHooks, SingleController
    from rolloutrun_runtime.contract.pod import MemberEndpoint
    from rolloutrun_runtime.contract.run_config import RunConfig
    from rolloutrun_runtime.lease_keeper import KeptLease

logger = logging.getLogger(__name__)

#: Torch threads in the trainer: the runs are tiny and share 2 cores with the generation
#: engine's thread and the Gym processes.
TORCH_THREADS = 1


@dataclass
class TrainerResult:
    """What a finished trainer run reports."""

    steps: int
    history: list[dict[str, Any]]
    final_weights_sha256: str
    resumed_from: str | None
    trained_prompt_ids: list[int]
    #: The level the run recovered at (``checkpointing.targetLevel``, or sibling where an
    #: environment server has no checkpoint control plane: see ``trainer_inputs``).
    recovery_level: str = ""


def register(parser: argparse.ArgumentParser) -> None:
    """Run a run's trainer: the single controller, its policy workers and checkpoints."""
    parser.add_argument("--config", required=True, help="RolloutRun or bare RunConfig YAML")
    parser.add_argument("--log-dir", default=None, help="override run.logDir")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    STARTUP.mark("command_loaded")  # the interpreter, the dispatcher and this module
    gc.disable()  # until the imports are done: see _imports_done
    from rolloutrun_runtime.lease_keeper import kept_lease_from_environment

    gym_token = take_gym_token()  # first: no child process of the trainer inherits it
    metrics_token = take_metrics_token()  # likewise (it opens /metrics only)
    pod = PodLease()
    # In a pod: the run's Lease (a KubernetesLease), held through a keeper process started
    # before torch is imported, so the kubernetes client's import runs on another core;
    # outside any cluster: no lease. Acquired below, before any side effect.
    lease = kept_lease_from_environment(on_lost=pod.lost)
    try:
        return _main(args, pod, lease, gym_token, metrics_token)
    finally:
        if lease is not None:
            lease.close()  # a keeper whose lease was never held (a config error) ends too


def _main(
    args: argparse.Namespace,
    pod: PodLease,
    lease: KeptLease | None,
    gym_token: str | None,
    metrics_token: str | None,
) -> int:
    from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import UnrestorableError
    from rolloutrun_runtime.contract.model_dir import local_model_problem
    from rolloutrun_runtime.contract.run_config import (
        UNRESTORABLE_EXIT_CODE,
        ConfigError,
        load_run_config,
    )
    from rolloutrun_runtime.coordination import FencedError, LeaseError, holding
    from rolloutrun_runtime.policy.hf_files import HFModelError
    from rolloutrun_runtime.prompt_data import PromptDataError

    try:
        cfg = load_run_config(resolve_config_path(args.config))
    except ConfigError as error:
        print(f"rolloutrun trainer: {error}", file=sys.stderr)
        return 2
    if args.log_dir:
        cfg = cfg.model_copy(update={"log_dir": str(args.log_dir)})
    STARTUP.mark("config_loaded")
    problem = cfg.policy.model and local_model_problem(cfg.policy.model)
    if problem:  # a restart finds the same directory: the config's exit, not a loop
        print(f"rolloutrun trainer: {problem}", file=sys.stderr)
        return UNRESTORABLE_EXIT_CODE
    if not cfg.gym.endpoints:
        print(
            "rolloutrun trainer: gym.endpoints is empty (use 'rolloutrun train')", file=sys.stderr
        )
        return 2
    try:
        with holding(lease) as held:
            pod.lease = held
            try:
                return asyncio.run(_run_until_signalled(cfg, pod, gym_token, metrics_token))
            finally:
                pod.close()  # the last progress (the forced snapshot) before the release
    except (FencedError, LeaseError) as error:
        print(f"rolloutrun trainer: {error}", file=sys.stderr)
        return EXIT_FENCED
    except (UnrestorableError, HFModelError, PromptDataError) as error:
        # A restart meets the same checkpoints, model and prompt file: the configuration's
        # exit (the operator fails the run), one line naming the file, row and field.
        print(f"rolloutrun trainer: {error}", file=sys.stderr)
        return UNRESTORABLE_EXIT_CODE


async def _run_until_signalled(
    cfg: RunConfig,
    pod: PodLease | None = None,
    gym_token: str | None = None,
    metrics_token: str | None = None,
) -> int:
    """Run the trainer; SIGTERM (a pod being stopped) cancels it cleanly, exit 143."""
    import signal

    pod = pod or PodLease()
    preemption = asyncio.Event()  # SIGTERM: snapshot within the grace, then stop (143)
    task = asyncio.ensure_future(
        run_trainer(
            cfg,
            hooks=_PodHooks(pod, cfg.grpo.max_steps),
            preemption=preemption,
            gym_token=gym_token,
            metrics_token=metrics_token,
            gym_members=pod.gym_members if pod.lease is not None else None,
        )
    )
    loop = asyncio.get_running_loop()
    pod.attach(loop, task)
    loop.add_signal_handler(signal.SIGTERM, preemption.set)
    try:
        await task
    except asyncio.CancelledError:
        if pod.lost_error is not None:
            logger.error("trainer fenced: %s", pod.lost_error)
            return EXIT_FENCED
        logger.warning("SIGTERM: trainer stopped before maxSteps")
        return 128 + signal.SIGTERM
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    return 0


async def run_trainer(
    cfg: RunConfig,
    *,
    hooks: RunHooks | None = None,
    preemption: asyncio.Event | None = None,
    gym_token: str | None = None,
    metrics_token: str | None = None,
    gym_members: Callable[[bool], Mapping[int, MemberEndpoint]] | None = None,
) -> TrainerResult:
    """Plan the resume (the newest restorable entry, if any), build the policy on its
    anchor's weights, the workers and the controller; restore what was planned; run.

    ``hooks.fence`` refuses a commit (a trainer checkpoint, a manifest) by raising;
    ``on_anchor``, ``on_published``, ``on_step`` get each committed ``step_<N>``, published
    manifest and step record. ``gym_token``, ``metrics_token``: the run's tokens the entry
    point took from its environment (None reads them there). ``gym_members``: where replaced
    Gym replicas serve now (:meth:`PodLease.gym_members`), asked afresh while one is down."""
    import torch

    STARTUP.mark("torch_imported")
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
    from rolloutrun_runtime.algorithms.single_controller import SingleController
    from rolloutrun_runtime.metrics import MetricsWriter
    from rolloutrun_runtime.policy.family import policy_tokenizer
    from rolloutrun_runtime.storage import open_storage
    from rolloutrun_runtime.trainer_inputs import (
        answered_gyms,
        close_answered_gyms,
        with_prompt_set,
    )
    from rolloutrun_runtime.workers import build_workers  # noqa: F401  (imported before the mark)

    STARTUP.mark("runtime_imported")
    _imports_done()
    cfg, prompts = with_prompt_set(cfg)  # task.dataset: read once, sizes the dataset
    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(cfg.seed)
    log_dir = _made(Path(cfg.log_dir))

    storage = open_storage(cfg.resolved_storage_uri())
    trace = TraceWriter(log_dir / TRACE_FILE if cfg.checkpointing.trace else None)
    observation = Observation(cfg, storage, log_dir, trace.run_id, metrics_token)
    hooks = _TrainerHooks(hooks, MetricsWriter(log_dir), log_dir / SNAPSHOTS_LOG, observation)
    checkpointer = fenced_checkpointer(
        storage, cfg.checkpointing.keep_latest, fence=hooks.fence, on_anchor=hooks.on_anchor
    )
    gym_token = _run_token(gym_token)
    async with contextlib.AsyncExitStack() as stack:  # unwound in reverse
        notice = stack.enter_context(_preemption_notice(preemption))  # also stops the start
        manifests = _snapshot_manifests(cfg, checkpointer.storage)
        stack.callback(manifests.close)
        stack.push_async_callback(observation.stop)  # after the trace closed: its last lines
        stack.callback(trace.close)  # reach the storage
        # the Gyms answer meanwhile: the plan, model and workers need none of it (answered_gyms)
        gyms = asyncio.create_task(answered_gyms(cfg, trace, gym_token, gym_members))
        stack.push_async_callback(close_answered_gyms, gyms)
        choice = await asyncio.to_thread(_planned_restore, cfg, manifests, checkpointer, trace)
        model, optimizer = await asyncio.to_thread(_model_and_optimizer, cfg, choice)
        workers = await _started_workers(cfg, model, choice, gym_token, stack)
        cfg, environment = await gyms
        STARTUP.mark("gyms_answered")
        await observation.start()
        controller = SingleController(
            cfg,
            model=model,
            optimizer=optimizer,
            workers=workers,
            gym_endpoints=list(cfg.gym.endpoints),
            checkpointer=checkpointer,
            pad_id=policy_tokenizer(cfg.policy).pad_id,
            trace=trace,
            manifests=manifests,
            environment=environment,
            hooks=hooks,
            gym_token=gym_token,
            prompt_payload=prompts.payload if prompts is not None else None,
            gym_members=gym_members,
        )
        resumed_from = await _resume_and_run(controller, choice, cfg, trace, storage, notice)
    return _finished(controller, log_dir, resumed_from)


def _snapshot_manifests(cfg: RunConfig, storage: Any) -> Any:
    """The snapshots' ManifestStore, their files written by a child process on file://
    (``storage/writer_process.py``: the writer thread no longer hands the interpreter lock
    back and forth with the event loop at every system call); closed by the caller."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
    from rolloutrun_runtime.storage import with_writer_process

    lease_s = lease_duration_from(os.environ)
    return ManifestStore(with_writer_process(storage), cfg.name, lease_duration_s=lease_s)


def _planned_restore(cfg: RunConfig, manifests: Any, checkpointer: Any, trace: Any) -> ResumeChoice:
    """What this incarnation resumes from, read and checked, before the model and the
    generation workers are built: so they are built on the anchor's weights, and a Hugging
    Face model's own weight files are never read on a resume (they would be replaced at
    once). Raises ``UnrestorableError`` when every committed entry is refused."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import RolloutRestorer

    restorer = RolloutRestorer(cfg, manifests=manifests, checkpointer=checkpointer, trace=trace)
    choice = restorer.plan()
    STARTUP.mark("restore_read")
    return choice


def _anchor_weights(choice: ResumeChoice) -> Mapping[str, Any] | None:
    """The model weights a planned restore starts from (None: a fresh run, or an anchor that
    is the run's initial weights)."""
    restored = choice.restored
    return restored.trainer.model_state if restored and restored.trainer else None


def _served_version(choice: ResumeChoice) -> int:
    """The weight version the generation workers start on: the anchor's step when they
    start on its weights, else 0 (one version number always names one set of weights)."""
    restored = choice.restored
    return restored.anchor_step if restored and _anchor_weights(choice) is not None else 0


async def _started_workers(
    cfg: RunConfig,
    model: Any,
    choice: ResumeChoice,
    token: str | None,
    stack: contextlib.AsyncExitStack,
) -> Any:
    """The generation workers, started on the model's weights under the version they are;
    stopped by ``stack``, also when their start is cancelled (a stop during the start)."""
    from rolloutrun_runtime.workers import build_workers

    host, port = generation_address()
    version = _served_version(choice)
    workers = build_workers(cfg, model.state_dict(), version, host=host, port=port, token=token)
    stack.push_async_callback(workers.stop)
    await workers.start()
    STARTUP.mark("workers_started")
    return workers


def _model_and_optimizer(cfg: RunConfig, choice: ResumeChoice) -> tuple[Any, Any]:
    """The policy model (built-in or ``policy.model``) and its Adam (no ``torch._dynamo``);
    on a resume the model is built around the anchor's weights (``_anchor_weights``)."""
    from rolloutrun_runtime.algorithms.optimizer import build_optimizer
    from rolloutrun_runtime.policy.family import build_policy_model

    model = build_policy_model(cfg.policy, cfg.seed, weights=_anchor_weights(choice))
    STARTUP.mark("model_built")
    optimizer = build_optimizer(model.parameters(), cfg.grpo.learning_rate)
    STARTUP.mark("optimizer_built")
    return model, optimizer


async def _resume_and_run(
    controller: SingleController,
    choice: ResumeChoice,
    cfg: RunConfig,
    trace: Any,
    storage: Any,
    notice: _preemption_notice,
) -> str | None:
    """Restore (a snapshot, a trainer checkpoint or nothing), train to ``maxSteps`` under the
    preemption snapshot, export an HF model's final weights; returns where it resumed from."""
    resumed_from = await _restore(controller, choice, trace)
    STARTUP.mark("run_started")
    _freeze_startup_objects()
    STARTUP.mark("gc_frozen")
    if controller.manifests is not None:
        # After the restore (its CPU not taken from the start-up), before any snapshot: a
        # preemption's snapshot in its grace period never waits for the child to start.
        controller.manifests.start_writer()
    notice.training(controller)  # a notice from here snapshots first
    try:
        if controller.trainer_version < cfg.grpo.max_steps:
            await controller.run()
    finally:
        notice.close()  # trained (or failed): the export below is not stopped by a notice
    if cfg.policy.model is not None and controller.trainer_version >= cfg.grpo.max_steps:
        await asyncio.to_thread(_export_final_model, cfg, controller.model, storage)
    return resumed_from


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _imports_done() -> None:
    """Cyclic GC back on after the pod entry point's imports, with what they left frozen.

    Why: importing torch and the runtime allocates ~300k long-lived objects, and with the
    collector on the allocations trigger young and full passes over them as they grow
    (~0.2-0.4 s of CPU, 10-20 % of the imports, before the first redispatch). ``main``
    turns the collector off first; here everything imported so far moves to the permanent
    generation (``gc.freeze``, the standard library's recipe for a pre-fork server: no pass
    over it) and the collector comes back on. The price: the cycles the imports left
    unreachable (~8.5k objects, ~2 MB, once) are never collected. A caller that never turned
    the collector off (``rolloutrun train`` and the tests run ``run_trainer`` in-process) is
    left as it was."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _freeze_startup_objects() -> None:
    """Start-up left ~190k long-lived objects (torch, the model, the restore); a full
    cyclic-GC pass over them takes 100-200 ms and stalls both pumps, and a snapshot's
    allocations make such passes frequent. Freeze them out of future passes (refcounting
    still frees what becomes unreachable). Only the young generations are collected first:
    a full pass here would itself cost that 100-200 ms before the first redispatch, to free
    the few dozen objects start-up leaves in unreachable cycles."""
    gc.collect(1)
    gc.freeze()


async def _restore(controller: SingleController, choice: ResumeChoice, trace: Any) -> str | None:
    """Resume the controller from the planned entry; returns its path, if any."""
    restored = await controller.restore(choice)
    resumed_from = restored.source.path if restored is not None else None
    if resumed_from:
        logger.info("resumed from %s", resumed_from)
    trace.emit(
        "run_started",
        incarnation=None,
        resumed_from=resumed_from,
        snapshot_id=restored.snapshot_id if restored is not None else None,
        cut_time=restored.cut_time if restored is not None else None,
    )
    return resumed_from


def _export_final_model(cfg: RunConfig, model: Any, storage: Any) -> None:
    """The final weights of a Hugging Face policy, in the Hugging Face layout, to
    ``<storage>/final_model/`` (rewritten whole by an incarnation that finishes again)."""
    import tempfile

    from rolloutrun_runtime.contract.layout import FINAL_MODEL_DIR
    from rolloutrun_runtime.policy.hf import export_hf

    assert cfg.policy.model is not None
    with tempfile.TemporaryDirectory() as scratch:
        files = export_hf(model, cfg.policy.model, Path(scratch))
        storage.upload_files({f"{FINAL_MODEL_DIR}/{path.name}": path for path in files})
    logger.info("exported the final model to %s", storage.uri_for(FINAL_MODEL_DIR))


def _finished(
    controller: SingleController, log_dir: Path, resumed_from: str | None
) -> TrainerResult:
    """Write the final weights' digest and report the run."""
    from rolloutrun_runtime.contract.layout import FINAL_WEIGHTS_FILE
    from rolloutrun_runtime.policy.model import state_sha256

    digest = state_sha256(controller.model.state_dict())
    (log_dir / FINAL_WEIGHTS_FILE).write_text(digest + "\n")
    logger.info(
        "trainer finished at step %d; weights sha256 %s", controller.trainer_version, digest
    )
    return TrainerResult(
        steps=controller.trainer_version,
        history=controller.history,
        final_weights_sha256=digest,
        resumed_from=resumed_from,
        trained_prompt_ids=controller.trained_prompt_ids,
        recovery_level=controller.cfg.checkpointing.target_level.value,
    )


class _TrainerHooks:
    """The caller's hooks, plus what the trainer itself records: each step in the metrics
    log, each snapshot attempt (outcome and timings) as one JSON line in ``snapshots.jsonl``."""

    def __init__(
        self, outer: RunHooks | None, metrics: Any, snapshots_log: Path, live: Any = None
    ) -> None:
        from rolloutrun_runtime.algorithms.single_controller.hooks import NoHooks

        self.outer: RunHooks = outer if outer is not None else NoHooks()
        self.metrics = metrics
        self.snapshots_log = snapshots_log
        self.live = live  # the trainer's Observation (logs in storage, /metrics), if any

    def fence(self) -> None:
        self.outer.fence()

    def on_step(self, record: dict[str, Any]) -> None:
        self.metrics.write(record)
        if self.live is not None:
            self.live.on_step(record)
        self.outer.on_step(record)

    def on_anchor(self, step: int) -> None:
        self.outer.on_anchor(step)

    def on_published(self, published: dict[str, Any]) -> None:
        if self.live is not None:
            self.live.on_published(published)
        self.outer.on_published(published)

    def on_snapshot(self, record: dict[str, Any]) -> None:
        with self.snapshots_log.open("a") as handle:
            handle.write(json.dumps(record, sort_keys=True, default=str) + "\n")
        if self.live is not None:
            self.live.on_snapshot(record)
        self.outer.on_snapshot(record)


class _PodHooks:
    """The pod's lease as run hooks: fencing, and progress annotations on the Lease; and one
    line per step in the pod's log (what ``kubectl logs`` shows)."""

    def __init__(self, pod: PodLease, max_steps: int = 0) -> None:
        self.pod = pod
        self.max_steps = max_steps
        self.last_snapshot_at: float | None = None

    def fence(self) -> None:
        self.pod.fence()  # nothing to fence without a lease

    def on_step(self, record: dict[str, Any]) -> None:
        import time

        from rolloutrun_runtime.metrics import format_step_line

        age = None if self.last_snapshot_at is None else time.time() - self.last_snapshot_at
        logger.info("%s", format_step_line(record, self.max_steps, age))
        self.pod.on_step(record)

    def on_anchor(self, step: int) -> None:
        self.pod.on_anchor(step)

    def on_published(self, published: dict[str, Any]) -> None:
        import time

        when = published.get("published_at")
        self.last_snapshot_at = float(when) if isinstance(when, int | float) else time.time()
        self.pod.on_published(published)

    def on_snapshot(self, record: dict[str, Any]) -> None:
        return None


def _run_token(gym_token: str | None) -> str | None:
    """The run's token: the one the entry point took, else ``ENV_GYM_TOKEN`` (in-process)."""
    from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN

    return gym_token if gym_token is not None else os.environ.get(ENV_GYM_TOKEN)


class _preemption_notice:
    """A preemption notice (SIGTERM) stops the run; the caller exits 143.

    Once the run trains, after a forced snapshot that must publish within
    ``preemptionGraceSeconds`` (:meth:`training`). Before (start-up, restore), at once:
    nothing was generated since the state it restores, and a start can wait on what the stop
    takes away (worker pods stopped with the trainer never join its Ray cluster; a Gym being
    deleted never answers), which held the pod for its whole grace period. The run task is
    cancelled either way.
    """

    def __init__(self, notice: asyncio.Event | None) -> None:
        self.notice = notice
        self.controller: Any = None
        self.watcher: asyncio.Task[None] | None = None

    def __enter__(self) -> _preemption_notice:
        if self.notice is not None:
            self.watcher = asyncio.ensure_future(self._watch(asyncio.current_task()))
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.cancel()

    def training(self, controller: Any) -> None:
        """From now on a notice forces ``controller``'s snapshot before the run stops."""
        self.controller = controller

    async def _watch(self, run: asyncio.Task[Any] | None) -> None:
        assert self.notice is not None
        await self.notice.wait()
        if self.controller is None:
            logger.warning("preemption notice during start-up: stopping (nothing to snapshot)")
        else:
            grace = self.controller.cfg.checkpointing.preemption_grace_seconds
            outcome = await self.controller.preemption_snapshot(grace)
            logger.warning("preemption notice: snapshot %s; stopping", outcome)
        if run is not None:
            run.cancel()
