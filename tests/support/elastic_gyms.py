"""In-process Gym replicas that can be "lost" and replaced, for the elastic-member tests.

Each replica is a real :class:`GymServer` with its checkpoint control plane (turn-level
snapshots copy its episodes) serving on loopback, its side effects in the run's audit file
``<logDir>/gym-<i>.audit.jsonl`` (what ``rolloutrun audit`` reads). :meth:`ElasticGyms.replace`
resets a replica's connections and stops its server (its process is gone: calls in flight
fail, its episodes stop mid-episode) and starts the next
member generation under the same instance id at a new port, announced as the operator
announces it (:class:`MemberEndpoint`, read by the trainer's ``gym_members``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from rolloutrun_runtime.contract.pod import MemberEndpoint
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.contract.wire import GYM_RUN_ROUTE


class ElasticGyms:
    """The replicas of one run; ``servers[(index, generation)]`` keeps every server built."""

    def __init__(
        self,
        cfg: RunConfig,
        token: str,
        *,
        down_s: float = 0.3,
        instance_id: Callable[[int], str] = "gym-{}".format,
    ) -> None:
        """``instance_id``: replica ``index``'s id in every generation (the launcher's
        ``gym-<i>``; a pod's is ``gym_instance_id(run, index)``)."""
        self.cfg = cfg
        self.instance_id = instance_id
        self.token = token
        self.down_s = down_s
        self.runners: dict[int, Any] = {}
        self.urls: list[str] = []
        self.members: dict[int, MemberEndpoint] = {}
        self.servers: dict[tuple[int, int], Any] = {}
        #: ``/run`` calls answered, by (index, generation).
        self.runs: dict[tuple[int, int], int] = {}
        #: Set once a replacement generation has answered a ``/run``.
        self.replacement_served = asyncio.Event()

    def audit_file(self, index: int) -> Path:
        return Path(self.cfg.log_dir) / f"gym-{index}.audit.jsonl"

    async def _serve(self, index: int, generation: int, port: int = 0) -> str:
        from rolloutrun_runtime.environments.gym import GymServer
        from rolloutrun_runtime.environments.gym.control import GymCheckpointControl
        from rolloutrun_runtime.policy.http import serve_app

        Path(self.cfg.log_dir).mkdir(parents=True, exist_ok=True)
        server = GymServer(
            self.instance_id(index), self.cfg, self.audit_file(index), token=self.token
        )
        control = GymCheckpointControl(server, self.token)
        server.continue_restored = control.claim_restored

        async def count(request: web.Request, _response: web.StreamResponse) -> None:
            if request.path == GYM_RUN_ROUTE:
                key = (index, generation)
                self.runs[key] = self.runs.get(key, 0) + 1
                if generation > 0:
                    self.replacement_served.set()

        server.app.on_response_prepare.append(count)
        # As ``rolloutrun gym`` serves: a handler is cancelled when its client goes away.
        runner, url = await serve_app(server.app, port=port, cancel_on_disconnect=True)
        self.runners[index] = runner
        self.servers[(index, generation)] = server
        return str(url)

    async def start(self) -> None:
        self.urls = [await self._serve(i, 0) for i in range(self.cfg.gym.replicas)]

    async def replace(self, index: int) -> None:
        """The pod of ``index`` is lost (its connections reset, its episodes stopped where
        they were); the next generation serves at a new port."""
        await self.lose(index)
        await asyncio.sleep(self.down_s)  # the operator's loss -> new pod, in miniature
        await self.come_back(index)

    async def lose(self, index: int) -> None:
        """The pod of ``index`` is gone: its connections reset, its server stopped."""
        runner = self.runners.pop(index)
        for handler in runner.server.connections if runner.server is not None else []:
            if handler.transport is not None:
                handler.transport.abort()
        await runner.cleanup()

    async def come_back(self, index: int, port: int = 0) -> None:
        """The next generation of ``index`` serves at a new port (``port``: that one, e.g.
        its first address, as a static endpoint's server comes back), announced as a member."""
        generation = self.members[index].generation + 1 if index in self.members else 1
        url = await self._serve(index, generation, port)
        self.members[index] = MemberEndpoint(index, url, generation)

    async def stop(self) -> None:
        runners, self.runners = self.runners, {}
        for runner in runners.values():
            await runner.cleanup()

    def config(self) -> RunConfig:
        """The run's config naming the first generation's addresses."""
        gym = self.cfg.gym.model_copy(update={"endpoints": list(self.urls)})
        return self.cfg.model_copy(update={"gym": gym})

    def endpoints(self, fresh: bool) -> dict[int, MemberEndpoint]:
        """What the operator wrote on the Lease (``gym_members`` of ``run_trainer``)."""
        return dict(self.members)
