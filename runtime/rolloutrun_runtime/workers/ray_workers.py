"""Ray policy workers: each generation server runs inside a Ray actor.

Why Ray: in pods the policy workers are placed like NeMo-RL places its vLLM workers, as
Ray actors that may live on other nodes of a Ray cluster (``workers.rayAddress``). Each
actor runs the generation engine and its HTTP server on the actor's event loop and takes
refits as actor calls; the weights travel once through the object store per refit, however
many actors there are.

Where the driver's Ray comes from (a private Ray on 127.0.0.1, a head on the pod address
for worker pods, a node joining a GCS address, Ray Client) is :mod:`.ray_cluster`'s; a Ray
already initialised by the caller is reused and left running. Actors placed on other nodes
(worker pods, a joined cluster) serve on their node's address; actors beside the trainer
serve where the trainer is reachable (``$POD_IP``).

A lost actor (its worker node gone: ``RayActorError`` on a refit) does not stop the run: its
endpoint leaves ``endpoints`` at once (the rollout pump sends no more episodes there), a
replacement actor is created under the same index (Ray places it when a node offering the
generation resource joins: the operator's replacement worker pod) and re-admitted as soon as
its server started, brought first to the weights of the latest refit (never between a refit
and its end: admission and refits take one lock). Why not wait for the next refit: in
deterministic mode a refit needs the step's groups, and when the survivors are lost too
(their deaths are found at a refit) nothing could generate them, so the run would wait for
the replacement that waits for a refit. Replacements of one index are bounded
(:data:`MAX_ACTOR_REPLACEMENTS`), and a refit that finds no actor left waits (bounded) for a
replacement: past either, a :class:`WorkerError` names the loss.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
import torch

from rolloutrun_runtime.contract.run_config import Device, RunConfig
from rolloutrun_runtime.policy.http import data_plane_token
from rolloutrun_runtime.workers import WorkerError
from rolloutrun_runtime.workers.ray_cluster import RayConnection, actor_resources

logger = logging.getLogger(__name__)

#: Intra-op threads of each generation actor: decode steps are small, and the machine's
#: cores are shared with the trainer and the Gym servers.
GENERATION_THREADS = 1
#: Seconds to wait for an actor to start its server or finish a call.
ACTOR_TIMEOUT_S = 120.0
#: Seconds the first actors wait for worker nodes to join (worker pods start after the
#: trainer's head, and may pull an image first).
NODE_JOIN_TIMEOUT_S = 600.0
#: Replacements of one generation actor (its node lost) before the run stops.
MAX_ACTOR_REPLACEMENTS = 8
#: Seconds an actor gets to close its server on stop (a lost node's actor never answers).
ACTOR_STOP_TIMEOUT_S = 5.0


@ray.remote(num_cpus=0)
class GenerationActor:
    """One generation server in its own process (an async actor: one event loop)."""

    def __init__(self, cfg_data: dict[str, Any], worker_index: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.cfg = RunConfig.model_validate(cfg_data)
        self.worker_index = worker_index
        self.runner: Any = None
        self.engine: Any = None

    async def start(
        self,
        state_dict: dict[str, torch.Tensor],
        version: int,
        bind_host: str | None,
        port: int = 0,
        token: str | None = None,
    ) -> dict[str, Any]:
        """Serve on ``bind_host`` (None: this node's address); returns where, on which
        node, with which custom resources assigned."""
        from rolloutrun_runtime.policy.generation import build_generation_app
        from rolloutrun_runtime.policy.http import serve_app
        from rolloutrun_runtime.workers.inprocess import make_engine

        self.engine = make_engine(self.cfg, state_dict, version, self.worker_index)
        host = bind_host or ray.util.get_node_ip_address()
        self.runner, url = await serve_app(
            build_generation_app(self.engine, token=token), host, port
        )
        context = ray.get_runtime_context()
        return {
            "url": url,
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "resources": dict(context.get_assigned_resources()),
        }

    async def refit(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        await self.engine.refit(state_dict, version)
        return int(self.engine.version)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


def actor_gpus(device: Device, cluster_gpus: float, workers: int) -> float:
    """GPUs each generation actor asks Ray for.

    Ray hides GPUs from actors that ask for none, so an actor that should compute on CUDA
    must ask: a whole GPU each when there are enough, else an even share.
    """
    if device is Device.CPU or (device is Device.AUTO and cluster_gpus < 1):
        return 0.0
    if device is Device.CUDA and cluster_gpus < 1:
        raise WorkerError("policy.device is 'cuda' but the Ray cluster has no GPUs")
    return min(1.0, cluster_gpus / workers)


async def _awaited(ref: Any) -> dict[str, Any]:
    return dict(await ref)


def _cpu_state(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach().to("cpu", copy=True) for key, value in state_dict.items()}


class RayWorkers:
    """``workers.generationWorkers`` generation actors; see the module doc."""

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
        self._initial: tuple[dict[str, torch.Tensor], int] | None = (state_dict, version)
        self._actors: list[Any] = []
        self._ray: RayConnection | None = None
        #: Per actor, where it serves and on which node (what ``start`` returned); None
        #: while the actor of that index is lost and its replacement not admitted.
        self.placements: list[dict[str, Any] | None] = []
        self._launch: tuple[Any, dict[str, Any], str | None, str] | None = None
        #: Replacement actors by index, with their starting server.
        self.pending: dict[int, tuple[Any, asyncio.Task[dict[str, Any]]]] = {}
        self.replacements: dict[int, int] = {}
        #: The weights every live actor holds (the latest refit's, or the start's): what a
        #: replacement is brought to before it is admitted.
        self._current: tuple[Any, int] | None = None
        #: Held by a refit from its first call to its end, and by an admission.
        self._refitting = asyncio.Lock()
        self._admitters: set[asyncio.Task[None]] = set()
        #: What ended an admission outside a refit (the next refit raises it).
        self._admission_error: WorkerError | None = None

    async def start(self) -> None:
        if self._initial is None:
            raise WorkerError("Ray workers were already started")
        state_dict, version = self._initial
        self._initial = None
        # Ray actors do not inherit the driver's environment: hand them the run's token.
        token = data_plane_token(self.token, "the generation workers")
        self._ray = RayConnection(self.cfg, self.host, self.cfg.log_dir, token)
        await asyncio.to_thread(self._ray.open)
        resources = actor_resources(self.cfg)
        # On other nodes (worker pods, a joined cluster) the servers listen on their node's
        # address; beside the trainer, where the trainer pod is reachable ($POD_IP).
        remote = bool(resources) or bool(self.cfg.workers.ray_address)
        bind_host = None if remote else self.host
        cfg_data = self.cfg.model_dump(mode="json")
        weights = ray.put(_cpu_state(state_dict))
        self._current = (weights, version)
        workers = self.cfg.workers.generation_workers
        gpus = actor_gpus(self.cfg.policy.device, ray.cluster_resources().get("GPU", 0), workers)
        actor = GenerationActor.options(  # type: ignore[attr-defined]
            num_gpus=gpus, resources=resources
        )
        self._launch = (actor, cfg_data, bind_host, token)
        self._actors = [
            actor.remote(cfg_data, index, GENERATION_THREADS) for index in range(workers)
        ]
        try:
            self.placements = list(
                await asyncio.wait_for(
                    asyncio.gather(
                        *[
                            a.start.remote(
                                weights,
                                version,
                                bind_host,
                                self.port if i == 0 and not remote else 0,
                                token,
                            )
                            for i, a in enumerate(self._actors)
                        ]
                    ),
                    NODE_JOIN_TIMEOUT_S if resources else ACTOR_TIMEOUT_S,
                )
            )
            self._live_endpoints()
        except (ray.exceptions.RayError, TimeoutError) as error:
            await self.stop()
            raise WorkerError(f"generation actors failed to start: {error}") from error
        logger.info(
            "Ray generation workers at %s placed %s",
            self.endpoints,
            self.placements,
        )

    def _live_endpoints(self) -> None:
        self.endpoints = [p["url"] for p in self.placements if p is not None]

    async def refit(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if not self._actors:
            raise WorkerError("refit before the workers were started")
        weights = ray.put(_cpu_state(state_dict))
        async with self._refitting:
            if self._admission_error is not None:
                raise self._admission_error
            self._current = (weights, version)
            await self._refit(weights, version)

    async def _refit(self, weights: Any, version: int) -> None:
        live = [(i, a) for i, a in enumerate(self._actors) if a is not None]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    *[a.refit.remote(weights, version) for _, a in live], return_exceptions=True
                ),
                ACTOR_TIMEOUT_S,
            )
        except TimeoutError as error:
            raise WorkerError(f"refit to version {version} timed out: {error}") from error
        for (index, _), result in zip(live, results, strict=True):
            if isinstance(result, ray.exceptions.RayActorError):
                self._lose(index, result, weights, version)
            elif isinstance(result, BaseException):
                raise WorkerError(f"refit to version {version} failed: {result}") from result
        if not self.endpoints and self.pending:  # every actor lost: wait for one
            tasks = [task for _, task in self.pending.values()]
            await asyncio.wait(tasks, timeout=NODE_JOIN_TIMEOUT_S, return_when="FIRST_COMPLETED")
        await self._admit(weights, version)
        if not self.endpoints:
            raise WorkerError(
                f"no generation worker left at version {version}: every actor was lost and "
                f"no replacement started within {NODE_JOIN_TIMEOUT_S:.0f} s"
            )

    def _lose(self, index: int, error: BaseException, weights: Any, version: int) -> None:
        """Actor ``index`` is gone (its node lost): out of ``endpoints`` now, a replacement
        created (bounded), admitted once its server runs (:meth:`_admit_once_started`)."""
        count = self.replacements.get(index, 0) + 1
        if count > MAX_ACTOR_REPLACEMENTS:
            raise WorkerError(
                f"generation worker {index} was lost {count} times (limit "
                f"{MAX_ACTOR_REPLACEMENTS}); last: {error}"
            ) from error
        self.replacements[index] = count
        logger.warning("generation worker %d lost (%s): replacing it (%d)", index, error, count)
        self._actors[index] = None
        self.placements[index] = None
        self._live_endpoints()
        assert self._launch is not None
        actor_class, cfg_data, bind_host, token = self._launch
        actor = actor_class.remote(cfg_data, index, GENERATION_THREADS)
        ref = actor.start.remote(weights, version, bind_host, 0, token)
        starting = asyncio.ensure_future(_awaited(ref))
        self.pending[index] = (actor, starting)
        admitter = asyncio.ensure_future(self._admit_once_started(actor, starting))
        self._admitters.add(admitter)
        admitter.add_done_callback(self._admitters.discard)

    async def _admit_once_started(self, actor: Any, starting: asyncio.Future[Any]) -> None:
        """Admit the replacement ``actor`` as soon as its server started (on the latest
        refit's weights), unless a refit admitted it (or lost it) first."""
        await asyncio.wait({starting})
        async with self._refitting:
            if not any(a is actor for a, _ in self.pending.values()) or self._current is None:
                return
            weights, version = self._current
            try:
                await self._admit(weights, version)
            except WorkerError as error:  # replacements exhausted: the next refit says so
                self._admission_error = error

    async def _admit(self, weights: Any, version: int) -> None:
        """Replacements whose server started: brought to ``version``, then served."""
        for index, (actor, task) in list(self.pending.items()):
            if not task.done():
                continue
            del self.pending[index]
            error = task.exception()
            if error is None:
                try:
                    await asyncio.wait_for(actor.refit.remote(weights, version), ACTOR_TIMEOUT_S)
                except (ray.exceptions.RayActorError, TimeoutError) as lost:
                    error = lost
            if isinstance(error, ray.exceptions.RayActorError | TimeoutError):
                self._lose(index, error, weights, version)
                continue
            if error is not None:
                raise WorkerError(f"generation worker {index} failed to restart: {error}")
            self._actors[index] = actor
            self.placements[index] = task.result()
            self._live_endpoints()
            logger.info("generation worker %d re-admitted at version %d", index, version)

    async def stop(self) -> None:
        admitters, self._admitters = self._admitters, set()
        for admitter in admitters:
            admitter.cancel()
        await asyncio.gather(*admitters, return_exceptions=True)
        actors, self._actors = self._actors, []
        for replacement, task in self.pending.values():  # not serving: nothing to stop
            task.cancel()
            ray.kill(replacement)
        self.pending = {}
        live = [actor for actor in actors if actor is not None]
        results = await asyncio.gather(
            *[asyncio.wait_for(a.stop.remote(), ACTOR_STOP_TIMEOUT_S) for a in live],
            return_exceptions=True,
        )
        for actor, result in zip(live, results, strict=True):
            if isinstance(result, ray.exceptions.RayError | TimeoutError):
                logger.warning("generation actor did not stop cleanly: %r", result)
            ray.kill(actor)
        self.endpoints = []
        self.placements = []
        connection, self._ray = self._ray, None
        if connection is not None:
            await asyncio.to_thread(connection.close)
