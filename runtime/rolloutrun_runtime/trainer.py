"""The trainer pod's entry point: ``rolloutrun trainer --config FILE [--log-dir DIR]``.

Why a separate module from the controller: the pod entry point owns the process-level
choices (threads, seeds, storage, worker backend, resume from the newest committed
``step_<N>``, the final-weights digest) and the controller stays a pure asyncio object that
tests build directly. ``rolloutrun train`` (the local launcher) calls ``run_trainer`` in its
own process after starting the Gym replicas.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rolloutrun_runtime.config import RunConfig

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


def register(parser: argparse.ArgumentParser) -> None:
    """Run a run's trainer: the single controller, its policy workers and checkpoints."""
    parser.add_argument("--config", required=True, help="RolloutRun or bare RunConfig YAML")
    parser.add_argument("--log-dir", default=None, help="override run.logDir")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    import asyncio

    from rolloutrun_runtime.config import ConfigError, load_run_config

    try:
        cfg = load_run_config(args.config)
    except ConfigError as error:
        print(f"rolloutrun trainer: {error}", file=sys.stderr)
        return 2
    if args.log_dir:
        cfg = cfg.model_copy(update={"log_dir": str(args.log_dir)})
    if not cfg.gym.endpoints:
        print(
            "rolloutrun trainer: gym.endpoints is empty (use 'rolloutrun train')", file=sys.stderr
        )
        return 2
    return asyncio.run(_run_until_signalled(cfg))


async def _run_until_signalled(cfg: RunConfig) -> int:
    """Run the trainer; SIGTERM (a pod being stopped) cancels it cleanly, exit 143."""
    import asyncio
    import logging
    import signal

    task = asyncio.ensure_future(run_trainer(cfg))
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        logging.getLogger(__name__).warning("SIGTERM: trainer stopped before maxSteps")
        return 128 + signal.SIGTERM
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
    return 0


async def run_trainer(
    cfg: RunConfig,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TrainerResult:
    """Build the policy, workers and controller; resume if a checkpoint exists; run."""
    import logging

    import torch

    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TRACE_FILE, TraceWriter
    from rolloutrun_runtime.algorithms.single_controller import (
        DATA_PLANE_PREFIX,
        LEDGER_FILE,
        RUNTIME_STATE_FILE,
        SingleController,
    )
    from rolloutrun_runtime.algorithms.trainer_checkpoint import TrainerCheckpointer
    from rolloutrun_runtime.data_plane.store import METADATA_FILE, ROWS_FILE
    from rolloutrun_runtime.metrics import FINAL_WEIGHTS_FILE, MetricsWriter
    from rolloutrun_runtime.policy.model import build_model, state_sha256
    from rolloutrun_runtime.policy.tokenizer import TOKENIZER
    from rolloutrun_runtime.storage import open_storage
    from rolloutrun_runtime.workers import build_workers

    logger = logging.getLogger(__name__)
    torch.set_num_threads(TORCH_THREADS)
    torch.manual_seed(cfg.seed)
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)

    model = build_model(cfg.policy, TOKENIZER.vocab_size, cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.grpo.learning_rate)
    checkpointer = TrainerCheckpointer(
        open_storage(cfg.resolved_storage_uri()), cfg.checkpointing.keep_latest
    )
    metrics = MetricsWriter(log_dir)

    def record(step: dict[str, Any]) -> None:
        metrics.write(step)
        if on_step is not None:
            on_step(step)

    latest = checkpointer.latest_step()
    loaded = None
    if latest is not None:
        extra = (
            LEDGER_FILE,
            RUNTIME_STATE_FILE,
            DATA_PLANE_PREFIX + ROWS_FILE,
            DATA_PLANE_PREFIX + METADATA_FILE,
        )
        loaded = checkpointer.load(latest, extra_names=extra)
        model.load_state_dict(loaded.model_state)
        logger.info("resuming from %s", loaded.uri)
    version = latest or 0
    trace = TraceWriter(log_dir / TRACE_FILE if cfg.checkpointing.trace else None)
    trace.emit(
        "run_started",
        incarnation=None,
        resumed_from=loaded.uri if loaded is not None else None,
        snapshot_id=None,
        cut_time=None,
    )
    workers = build_workers(cfg, model.state_dict(), version)
    await workers.start()
    try:
        controller = SingleController(
            cfg,
            model=model,
            optimizer=optimizer,
            workers=workers,
            gym_endpoints=list(cfg.gym.endpoints),
            checkpointer=checkpointer,
            on_step=record,
            pad_id=TOKENIZER.pad_id,
            trace=trace,
        )
        if loaded is not None:
            controller.restore_trainer_checkpoint(loaded)
        if controller.trainer_version < cfg.grpo.max_steps:
            await controller.run()
    finally:
        await workers.stop()
        trace.close()
    digest = state_sha256(model.state_dict())
    (log_dir / FINAL_WEIGHTS_FILE).write_text(digest + "\n")
    logger.info(
        "trainer finished at step %d; weights sha256 %s", controller.trainer_version, digest
    )
    return TrainerResult(
        steps=controller.trainer_version,
        history=controller.history,
        final_weights_sha256=digest,
        resumed_from=loaded.uri if loaded is not None else None,
        trained_prompt_ids=controller.trained_prompt_ids,
    )
