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
serve where the trainer is reachable (``$POD_IP``). On worker nodes each actor serves on
one of the node's generation ports (the pod's generation port and the next, one per
generation slot: the span the worker pods' NetworkPolicy admits the run's Gyms to), any
free port only when a dead actor's process still holds them.

A lost actor (its worker node gone) does not stop the run. Each admitted actor carries a
watch (a call of :meth:`GenerationActor.watch` that returns only when the actor dies), so
Ray's report of the death (the watch fails with ``RayActorError``; a refit finding it dead
is the fallback) takes its endpoint out of ``endpoints`` at once, not at the next refit:
the rollout pump's :class:`~rolloutrun_runtime.workers.endpoints.PolicyEndpoints` reads
``endpoints`` on every pick and gives no more episodes there. A replacement actor is created
under the same index at once (Ray places it when a node offering the generation resource
joins: the operator's replacement worker pod) and re-admitted as soon as its server started,
brought first to the latest refit's weights (never between a refit and its end: admissions
and refits hold one lock). Why not at the next refit: in deterministic mode a refit needs
the step's groups, and with every actor lost nothing could generate them, so the run would
wait for a replacement that waits for a refit. Replacements of
one index are bounded (:data:`MAX_ACTOR_REPLACEMENTS`), and a refit that finds no actor
left waits (bounded) for a replacement: past either, a :class:`WorkerError` names the loss
(a watch that runs past the bound hands its error to the next refit).

Warm standbys (``workers.standbyWorkers``, from ``spec.workers.standby``): that many more
actors are started beside the active ones, each serving on a worker node, but their
endpoints are handed to no Gym. When an active actor is lost, a started standby is admitted
under its index at once (brought first to the latest refit's weights, under the same lock
as refits: the same path as a replacement whose server started), and a new standby actor is
created to refill the pool (Ray places it when the operator's new worker pod joins). A new
worker pod's start (its Ray node joining, the actor's imports and server start: ~10 s) is
then off the path of a loss. A lost active actor counts a replacement of its index whether a
standby took its place or a new actor did (the bound is the same); a standby lost while
waiting is replaced in the pool (bounded: :data:`MAX_ACTOR_REPLACEMENTS` per standby). With
no started standby at the loss, a replacement actor is created under the index as without
standbys; a standby that starts before it takes the index at once, and the replacement
joins the pool instead (the pool refilling slower than losses come). Which actor serves
does not change results (see the oracle).

With worker nodes the GPUs each actor asks for are read once the expected worker nodes
(``workers.workerNodes``) have joined, from the nodes that offer the generation resource
(:func:`generation_gpus`): read at once, the cluster is the head alone (0 GPUs, or the
head's), and the actors would ask for the wrong share.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
import torch

from rolloutrun_runtime.aio import EventFirst, unless_set
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.policy.http import data_plane_token
from rolloutrun_runtime.workers import (
    STANDBY_ADMITTED_LOG,
    STANDBY_LOST_LOG,
    STANDBY_STARTED_LOG,
    WorkerError,
)
from rolloutrun_runtime.workers.ray_cluster import RayConnection, actor_resources
from rolloutrun_runtime.workers.ray_placement import (
    NODE_POLL_S,
    actor_gpus,
    candidate_ports,
    joined_generation_gpus,
    node_ports,
)

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
        port_span: int = 1,
    ) -> dict[str, Any]:
        """Serve on ``bind_host`` (None: this node's address), on the first free port of
        :func:`candidate_ports`; returns where, on which node, with which custom resources
        assigned."""
        from rolloutrun_runtime.policy.generation import build_generation_app
        from rolloutrun_runtime.policy.http import serve_app
        from rolloutrun_runtime.workers.inprocess import make_engine

        self.engine = make_engine(self.cfg, state_dict, version, self.worker_index)
        host = bind_host or ray.util.get_node_ip_address()
        for candidate in candidate_ports(port, port_span):
            try:
                app = build_generation_app(self.engine, token=token)
                self.runner, url = await serve_app(app, host, candidate)
                break
            except OSError:
                if candidate == 0:
                    raise
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

    async def watch(self) -> None:
        """Never returns: the caller's reference fails when this actor dies."""
        await asyncio.Event().wait()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def _awaited(ref: Any) -> dict[str, Any]:
    return dict(await ref)


async def _awaited_any(ref: Any) -> Any:
    return await ref


#: What a refit's call on an actor returns when the actor's watch found it dead first.
FOUND_LOST = object()


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
        self._launch: tuple[Any, dict[str, Any], str | None, str, int] | None = None
        #: Replacement actors by index, with their starting server.
        self.pending: dict[int, tuple[Any, asyncio.Future[dict[str, Any]]]] = {}
        self.replacements: dict[int, int] = {}
        #: The weights (an object-store reference) and version of the last start or refit:
        #: what a replacement created between refits starts on.
        self._current: tuple[Any, int] | None = None
        self._watches: dict[int, asyncio.Task[None]] = {}
        #: A loss past the bound found by a watch, raised by the next refit.
        self._failure: WorkerError | None = None
        #: Held by a refit and by an admission between refits: never both at once.
        self._lock = asyncio.Lock()
        self._admitting: set[asyncio.Task[None]] = set()
        #: Started standby actors (served by no Gym) with what their ``start`` returned,
        #: and those still starting.
        self.standbys: list[tuple[Any, dict[str, Any]]] = []
        self.standby_starting: dict[int, tuple[Any, asyncio.Future[dict[str, Any]]]] = {}
        self._standby_serial = 0
        self._standby_watches: dict[int, asyncio.Task[None]] = {}
        #: Standby actors lost while waiting (their node lost), and standbys admitted.
        self.standby_losses = 0
        self.promotions = 0
        #: Per active actor (by id) a refit may wait on: set when its watch finds it dead.
        self._lost: dict[int, asyncio.Event] = {}

    async def start(self) -> None:
        if self._initial is None:
            raise WorkerError("Ray workers were already started")
        state_dict, version = self._initial
        self._initial = None
        # Ray actors do not inherit the driver's environment: hand them the run's token.
        token = data_plane_token(self.token, "the generation workers")
        self._ray = RayConnection(self.cfg, self.host, self.cfg.log_dir, token)
        await self._opened(self._ray)
        resources = actor_resources(self.cfg)
        # On other nodes (worker pods, a joined cluster) the servers listen on their node's
        # address; beside the trainer, where the trainer pod is reachable ($POD_IP).
        remote = bool(resources) or bool(self.cfg.workers.ray_address)
        bind_host = None if remote else self.host
        # On worker nodes: the generation ports from the pod's (one per slot), as their
        # NetworkPolicy admits the Gyms there; a joined cluster's nodes: any free port.
        span = node_ports(self.cfg) if resources else 0
        cfg_data = self.cfg.model_dump(mode="json")
        weights = ray.put(_cpu_state(state_dict))
        self._current = (weights, version)
        workers = self.cfg.workers.generation_workers
        self._current = (weights, version)
        try:
            gpus = actor_gpus(self.cfg.policy.device, await self._cluster_gpus(), workers)
        except WorkerError:
            await self.stop()
            raise
        actor = GenerationActor.options(  # type: ignore[attr-defined]
            num_gpus=gpus, resources=resources
        )
        self._launch = (actor, cfg_data, bind_host, token, span)
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
                                self.port if (i == 0 and not remote) or span else 0,
                                token,
                                max(span, 1),
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
        for index, started in enumerate(self._actors):
            self._watch(index, started)
        for _ in range(self.cfg.workers.standby_workers):
            self._new_standby()
        logger.info(
            "Ray generation workers at %s placed %s",
            self.endpoints,
            self.placements,
        )

    @staticmethod
    async def _opened(connection: RayConnection) -> None:
        """``connection`` opened in a thread; a stop meanwhile (the task cancelled) makes the
        thread give up at its next try and waits for it, so :meth:`stop` then closes what it
        left and the process does not wait on the thread as it exits."""
        opening = asyncio.ensure_future(asyncio.to_thread(connection.open))
        try:
            await asyncio.shield(opening)
        except asyncio.CancelledError:
            connection.abandon()
            await asyncio.wait({opening})
            if not opening.cancelled():
                opening.exception()  # retrieved: the stop, not this, is what ends the start
            raise

    async def _cluster_gpus(self) -> float:
        """The GPUs the actors share: with worker nodes, theirs once they joined."""
        expected = self.cfg.workers.worker_nodes
        if expected:
            return await joined_generation_gpus(expected, NODE_JOIN_TIMEOUT_S)
        return float(ray.cluster_resources().get("GPU", 0))

    def _live_endpoints(self) -> None:
        self.endpoints = [p["url"] for p in self.placements if p is not None]

    def _watch(self, index: int, actor: Any) -> None:
        """Until ``actor`` (serving index ``index``) dies: then :meth:`_lose` it at once."""

        async def watch() -> None:
            try:
                while True:
                    try:
                        await actor.watch.remote()
                    except ray.exceptions.ActorUnavailableError:  # not known dead: ask again
                        await asyncio.sleep(NODE_POLL_S)
            except ray.exceptions.RayActorError as error:
                self._lost_signal(actor).set()  # a refit waiting on it goes on without it
                self._lost.pop(id(actor), None)
                if self._current is None or self._actors[index] is not actor:
                    return  # stopped, or already found lost by a refit
                try:
                    self._lose(index, error, *self._current)
                except WorkerError as failure:
                    self._failure = failure
                self._admit_started()

        self._watches[index] = asyncio.ensure_future(watch())

    def _admit_started(self) -> None:
        """Admit the replacements whose servers started, now, on the latest refit's weights
        (after a refit in flight: the lock orders them)."""
        started = any(task.done() for _, task in self.pending.values())
        if self._current is None or not started:
            return
        admission = asyncio.ensure_future(self._admit_now())
        self._admitting.add(admission)
        admission.add_done_callback(self._admitting.discard)

    async def _admit_now(self) -> None:
        async with self._lock:  # after a refit in flight: its weights are the current ones
            if self._current is None:
                return
            try:
                await self._admit(*self._current)
            except WorkerError as failure:
                self._failure = failure

    async def refit(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        async with self._lock:
            await self._refit(state_dict, version)

    async def _refit(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if not self._actors:
            raise WorkerError("refit before the workers were started")
        if self._failure is not None:
            raise self._failure
        weights = ray.put(_cpu_state(state_dict))
        self._current = (weights, version)
        live = [(i, a) for i, a in enumerate(self._actors) if a is not None]
        try:
            results = await asyncio.wait_for(
                asyncio.gather(
                    *[self._refit_one(a, weights, version) for _, a in live],
                    return_exceptions=True,
                ),
                ACTOR_TIMEOUT_S,
            )
        except TimeoutError as error:
            raise WorkerError(f"refit to version {version} timed out: {error}") from error
        for (index, actor), result in zip(live, results, strict=True):
            if result is FOUND_LOST:
                continue  # its watch found it lost (and replaced it) while the refit waited
            if isinstance(result, ray.exceptions.RayActorError):
                if self._actors[index] is actor:  # else its watch found it lost already
                    self._lose(index, result, weights, version)
            elif isinstance(result, BaseException):
                raise WorkerError(f"refit to version {version} failed: {result}") from result
        if self._failure is not None:  # a watch found a loss past the bound meanwhile
            raise self._failure
        deadline = time.monotonic() + NODE_JOIN_TIMEOUT_S
        await self._admit(weights, version)
        # Every actor lost: wait for a replacement; one that failed to start (its node lost
        # too) was replaced again by _admit (bounded), so wait on, up to the deadline.
        while not self.endpoints and self.pending and time.monotonic() < deadline:
            tasks = [task for _, task in self.pending.values()]
            left = deadline - time.monotonic()
            await asyncio.wait(tasks, timeout=left, return_when="FIRST_COMPLETED")
            await self._admit(weights, version)
        if not self.endpoints:
            raise WorkerError(
                f"no generation worker left at version {version}: every actor was lost and "
                f"no replacement started within {NODE_JOIN_TIMEOUT_S:.0f} s"
            )

    async def _refit_one(self, actor: Any, weights: Any, version: int) -> Any:
        """``actor``'s refit, or :data:`FOUND_LOST` as soon as its watch finds it dead: a
        call in flight on a lost node's actor can take seconds more to fail than the watch,
        and the refit holds the lock a standby's admission waits for."""
        call = _awaited_any(actor.refit.remote(weights, version))
        try:
            return await unless_set(call, self._lost_signal(actor))
        except EventFirst:
            return FOUND_LOST

    def _lost_signal(self, actor: Any) -> asyncio.Event:
        return self._lost.setdefault(id(actor), asyncio.Event())

    def _lose(self, index: int, error: BaseException, weights: Any, version: int) -> None:
        """Actor ``index`` is gone (its node lost): out of ``endpoints`` now, a replacement
        created (bounded), admitted once its server runs (:meth:`_admit_started`)."""
        self._actors[index] = None
        self.placements[index] = None
        self._live_endpoints()
        count = self.replacements.get(index, 0) + 1
        if count > MAX_ACTOR_REPLACEMENTS:
            raise WorkerError(
                f"generation worker {index} was lost {count} times (limit "
                f"{MAX_ACTOR_REPLACEMENTS}); last: {error}"
            ) from error
        self.replacements[index] = count
        logger.warning("generation worker %d lost (%s): replacing it (%d)", index, error, count)
        if self.standbys:  # a warm standby takes its place now; the pool is refilled
            self._promote(index)
            return
        actor, ref = self._create(index, weights, version)
        starting = asyncio.ensure_future(_awaited(ref))
        starting.add_done_callback(lambda _: self._admit_started())
        self.pending[index] = (actor, starting)

    def _create(self, worker_index: int, weights: Any, version: int) -> tuple[Any, Any]:
        """A new generation actor and the reference of its ``start`` (its server)."""
        assert self._launch is not None
        actor_class, cfg_data, bind_host, token, span = self._launch
        actor = actor_class.remote(cfg_data, worker_index, GENERATION_THREADS)
        port = self.port if span else 0
        ref = actor.start.remote(weights, version, bind_host, port, token, max(span, 1))
        return actor, ref

    def _promote(self, index: int, refill: bool = True) -> None:
        """The oldest started standby serves index ``index``: handed to :meth:`_admit` as a
        replacement whose server has started (brought to the latest refit's weights under
        the refits' lock, then served); with ``refill``, a new standby is created."""
        actor, placement = self.standbys.pop(0)
        watch = self._standby_watches.pop(id(actor), None)
        if watch is not None:
            watch.cancel()  # from now on the index's watch follows it
        started: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        started.set_result(placement)
        self.pending[index] = (actor, started)
        self.promotions += 1
        logger.info(
            "generation worker %d" + STANDBY_ADMITTED_LOG + "%s admitted", index, placement["url"]
        )
        self._admit_started()
        if refill:
            self._new_standby()

    def _new_standby(self) -> None:
        """One more standby actor, started on the latest weights; it joins the pool once its
        server runs."""
        if self._current is None:
            return
        # worker indices past the active ones: each actor its own sampling seed
        worker_index = self.cfg.workers.generation_workers + self._standby_serial
        actor, ref = self._create(worker_index, *self._current)
        self._pool_starting(actor, asyncio.ensure_future(_awaited(ref)))

    def _pool_starting(self, actor: Any, starting: asyncio.Future[dict[str, Any]]) -> None:
        serial = self._standby_serial
        self._standby_serial += 1
        self.standby_starting[serial] = (actor, starting)
        starting.add_done_callback(lambda task: self._standby_started(serial, actor, task))

    def _standby_started(self, serial: int, actor: Any, task: asyncio.Future[Any]) -> None:
        self.standby_starting.pop(serial, None)
        if self._current is None or task.cancelled():
            return
        error = task.exception()
        if error is None:
            self.standbys.append((actor, task.result()))
            self._watch_standby(actor)
            logger.info(
                STANDBY_STARTED_LOG + " %s (%d in the pool)",
                task.result()["url"],
                len(self.standbys),
            )
            # an index lost while no standby had started waits for its replacement actor:
            # this standby serves it now, and that replacement joins the pool instead
            waiting = [i for i, (_, t) in self.pending.items() if not t.done()]
            if waiting:
                replacement, starting = self.pending.pop(waiting[0])
                self._pool_starting(replacement, starting)
                self._promote(waiting[0], refill=False)
        else:
            self._standby_lost(error)

    def _standby_lost(self, error: BaseException) -> None:
        """A standby died before it served (its node lost): another one, bounded."""
        self.standby_losses += 1
        limit = MAX_ACTOR_REPLACEMENTS * max(1, self.cfg.workers.standby_workers)
        if self.standby_losses > limit:
            self._failure = WorkerError(
                f"standby generation workers were lost {self.standby_losses} times (limit "
                f"{limit}); last: {error}"
            )
            return
        logger.warning(STANDBY_LOST_LOG + " (%s): starting another", error)
        self._new_standby()

    def _watch_standby(self, actor: Any) -> None:
        """Until the standby ``actor`` dies or is promoted: out of the pool if it dies."""

        async def watch() -> None:
            try:
                while True:
                    try:
                        await actor.watch.remote()
                    except ray.exceptions.ActorUnavailableError:
                        await asyncio.sleep(NODE_POLL_S)
            except ray.exceptions.RayActorError as error:
                self._standby_watches.pop(id(actor), None)
                kept = [entry for entry in self.standbys if entry[0] is not actor]
                if self._current is None or len(kept) == len(self.standbys):
                    return  # stopped, or promoted meanwhile
                self.standbys = kept
                self._standby_lost(error)

        self._standby_watches[id(actor)] = asyncio.ensure_future(watch())

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
            self._watch(index, actor)
            logger.info(
                "generation worker %d re-admitted at version %d at %s",
                index,
                version,
                self.placements[index]["url"],  # type: ignore[index]
            )

    async def stop(self) -> None:
        self._current = None
        watches = [*self._watches.values(), *self._admitting, *self._standby_watches.values()]
        self._watches, self._admitting, self._standby_watches = {}, set(), {}
        for watch in watches:
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        actors, self._actors = self._actors, []
        for replacement, task in self.pending.values():  # not serving: nothing to stop
            task.cancel()
            ray.kill(replacement)
        self.pending = {}
        for standby, task in self.standby_starting.values():
            task.cancel()
            ray.kill(standby)
        self.standby_starting = {}
        actors = [*actors, *(standby for standby, _ in self.standbys)]
        self.standbys = []
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
