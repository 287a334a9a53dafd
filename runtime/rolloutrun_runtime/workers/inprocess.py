"""In-process policy workers: generation servers on the caller's own event loop.

Why: tests and tiny local runs should not pay for Ray (seconds to start, most of a GiB).
The engine still computes in its own thread, so the caller's loop keeps serving HTTP and
running its pumps while the model decodes.
"""

from __future__ import annotations

import logging
import time

import torch
from aiohttp import web

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.policy.family import policy_tokenizer
from rolloutrun_runtime.policy.generation import GenerationEngine, build_generation_app
from rolloutrun_runtime.policy.http import serve_app
from rolloutrun_runtime.workers import WorkerError

logger = logging.getLogger(__name__)


def make_engine(
    cfg: RunConfig, state_dict: dict[str, torch.Tensor], version: int, worker_index: int
) -> GenerationEngine:
    """The engine one worker runs: batch-invariant in deterministic mode."""
    tokenizer = policy_tokenizer(cfg.policy)
    return GenerationEngine(
        cfg.policy,
        tokenizer.vocab_size,
        tokenizer.eos_id,
        state_dict,
        version,
        batch_invariant=cfg.checkpointing.deterministic,
        seed=cfg.seed * 1009 + worker_index,
        stop_ids=tokenizer.stop_ids,
    )


class InProcessWorkers:
    """``workers.generationWorkers`` engines, each behind an HTTP server on 127.0.0.1."""

    def __init__(
        self,
        cfg: RunConfig,
        state_dict: dict[str, torch.Tensor],
        version: int,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.host = host
        self.port = port
        self.token = token
        self.endpoints: list[str] = []
        self.engines: list[GenerationEngine] = []
        self._initial: tuple[dict[str, torch.Tensor], int] | None = (state_dict, version)
        self._runners: list[web.AppRunner] = []

    async def start(self) -> None:
        if self._initial is None:
            raise WorkerError("in-process workers were already started")
        state_dict, version = self._initial
        self._initial = None
        try:
            for index in range(self.cfg.workers.generation_workers):
                engine = make_engine(self.cfg, state_dict, version, index)
                port = self.port if index == 0 else 0
                runner, url = await serve_app(
                    build_generation_app(engine, token=self.token), self.host, port
                )
                self.engines.append(engine)
                self._runners.append(runner)
                self.endpoints.append(url)
        except OSError as error:
            await self.stop()
            raise WorkerError(f"could not start a generation server: {error}") from error
        logger.info("in-process generation workers at %s", self.endpoints)

    async def refit(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if not self.engines:
            raise WorkerError("refit before the workers were started")
        for engine in self.engines:
            await engine.refit(state_dict, version)

    async def until_idle(self, timeout_s: float, quiet_s: float = 0.0) -> bool:
        """Wait until every engine is between calls and has been for ``quiet_s``, at most
        ``timeout_s`` in all (:class:`~rolloutrun_runtime.workers.SharesTrainerLoop`)."""
        deadline = time.monotonic() + timeout_s
        for engine in self.engines:
            if not await engine.until_idle(max(deadline - time.monotonic(), 0.0), quiet_s):
                return False
        return all(engine.idle for engine in self.engines)

    async def stop(self) -> None:
        runners, self._runners = self._runners, []
        for runner in runners:
            await runner.cleanup()  # stops its engine too
        self.engines.clear()
        self.endpoints.clear()
