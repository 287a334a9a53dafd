"""The generation engine: continuous batching over a KV cache, across weight refits.

Why continuous batching: rollouts are many short model calls (one per Gym turn) that arrive
and finish at different times. The engine runs one decode step at a time over every running
call; new calls join at the next step (their prompt is prefilled into the cache in the same
step) and finished calls leave at once, so no call waits for a batch to fill or drain.

Why versions per token: the trainer refits the weights after every optimizer step while
calls are running. Like vLLM across a refit, a running call is not dropped: an unpinned
call's tokens after the refit are computed by the new weights (its prefix is re-encoded into
a fresh cache under them) and each token reports the version that produced it. A call may
instead pin a version (deterministic mode); the engine keeps the last ``keep_versions``
versions, and never evicts one a running call still uses.

Why a worker thread: the step's tensor work runs in one dedicated thread (torch releases
the GIL), so the event loop keeps serving HTTP while the model computes. ``threaded=False``
computes on the loop itself (yielding between steps): on a busy 2-core machine neither mode
wins clearly, so the thread stays the default for its steadier latency.

Batch-invariant mode (for deterministic runs) computes every call on its own: a decode step
of one row then gives bit-identical logits whatever else is running, at a throughput cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from rolloutrun_runtime.contract.run_config import PolicyConfig
from rolloutrun_runtime.policy.family import PolicyModel, build_policy_model
from rolloutrun_runtime.policy.http import GenerationRequest, GenerationResult
from rolloutrun_runtime.policy.model import resolve_device
from rolloutrun_runtime.policy.token_capture import TokenCapture

logger = logging.getLogger(__name__)

#: Weight versions kept so that calls may pin one (the latest is always kept).
KEEP_VERSIONS = 4
#: Most calls computing at once; further calls wait for a free row.
MAX_RUNNING_CALLS = 256


class GenerationError(Exception):
    """Base class of the engine's errors."""


class InvalidRequestError(GenerationError):
    """The request cannot be served as asked (bad ids, no room to generate)."""


class UnknownVersionError(GenerationError):
    """A call pinned a weight version the engine does not hold."""


class RefitError(GenerationError):
    """A refit was refused (an older version, other weights under the installed version,
    weights that do not fit the model)."""


def _same_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``model`` holds exactly ``state_dict`` (as loading it would: cast to the
    model's dtype and device)."""
    held = model.state_dict()
    if held.keys() != state_dict.keys():
        return False
    return all(
        torch.equal(held[name], value.to(device=held[name].device, dtype=held[name].dtype))
        for name, value in state_dict.items()
    )


class EngineClosedError(GenerationError):
    """The engine was stopped while the call waited or ran."""


@dataclass(eq=False)
class _Call:
    request: GenerationRequest
    future: asyncio.Future[GenerationResult]
    rng: random.Random
    tokens: list[int]
    version: int = -1  # version whose cache holds this call's prefix
    cached: int = 0  # tokens of ``tokens`` already in that cache
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def pinned(self) -> bool:
        return self.request.weight_version is not None


class _Group:
    """The calls running under one weight version, and their KV cache rows (0..n-1)."""

    def __init__(self, model: PolicyModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.calls: list[_Call] = []
        self.cache = model.new_cache(8, device)

    def add(self, call: _Call) -> None:
        if len(self.calls) == self.cache.shape[2]:
            grown = self.model.new_cache(2 * len(self.calls), self.device)
            grown[:, :, : len(self.calls)] = self.cache
            self.cache = grown
        call.cached = 0
        self.calls.append(call)

    def remove(self, call: _Call) -> None:
        """Drop ``call`` and keep rows contiguous by moving the last call into its row."""
        row = self.calls.index(call)
        last = len(self.calls) - 1
        if row != last:
            moved = self.calls[last]
            self.calls[row] = moved
            # Copy every position the moved call may have written: within a step a call's
            # new key is in the cache before its ``cached`` count catches up.
            span = len(moved.tokens)
            self.cache[:, :, row, :, :span] = self.cache[:, :, last, :, :span]
        self.calls.pop()


def sample_rows(
    logits: torch.Tensor, temperatures: list[float], uniforms: list[float]
) -> tuple[list[int], list[float]]:
    """Sample one token per row by inverse CDF; return the tokens and their logprobs.

    The logprob is that of the distribution sampled from (logits / temperature); a row with
    temperature 0 takes the argmax and reports the untempered logprob.
    """
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
    logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)
    cdf = torch.cumsum(logp.exp(), dim=-1)
    u = torch.tensor(uniforms, device=logits.device, dtype=cdf.dtype)[:, None]
    # Scale u by each row's total mass so rounding in the cumsum never runs past the end.
    sampled = torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_(max=logits.shape[-1] - 1)
    greedy = logp.argmax(dim=-1, keepdim=True)
    is_greedy = torch.tensor([t <= 0 for t in temperatures], device=logits.device)[:, None]
    chosen = torch.where(is_greedy, greedy, sampled)
    chosen_logp = logp.gather(-1, chosen)
    return chosen.squeeze(-1).tolist(), chosen_logp.squeeze(-1).tolist()


class GenerationEngine:
    """Serves ``generate`` calls from a continuously batched decode loop; see the module doc."""

    def __init__(
        self,
        cfg: PolicyConfig,
        vocab_size: int,
        eos_id: int,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        keep_versions: int = KEEP_VERSIONS,
        max_running: int = MAX_RUNNING_CALLS,
        batch_invariant: bool = False,
        seed: int | None = None,
        threaded: bool = True,
        stop_ids: Iterable[int] = (),
    ) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be at least 1")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        #: A call stops at ``eos_id`` or any of these (a model's several eos_token_id).
        self.stop_ids = frozenset({eos_id, *stop_ids})
        self.device = resolve_device(cfg)
        self.keep_versions = keep_versions
        self.max_running = max_running
        self.batch_invariant = batch_invariant
        self.threaded = threaded
        self.capture = TokenCapture()
        self._rng = random.Random(seed)
        # Built around the weights it is handed: a Hugging Face template reads no weights.
        try:
            template = build_policy_model(cfg, seed=0, vocab_size=vocab_size, weights=state_dict)
        except (RuntimeError, KeyError) as error:
            raise RefitError(f"weights do not fit the policy model: {error}") from error
        self._template = template.eval().requires_grad_(False)
        self._spare: list[torch.nn.Module] = []  # evicted models, reused by the next refit
        self._models: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self._models[version] = self._load(state_dict)
        self._groups: dict[int, _Group] = {}
        self._pending: list[_Call] = []
        self._wake = asyncio.Event()
        #: Set while the step loop sleeps for want of calls (see ``until_idle``), and since
        #: when (monotonic seconds) it last began to.
        self._idle = asyncio.Event()
        self._idle_since = float("-inf")
        self._loop_task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self.tokens_generated = 0
        self.steps = 0

    # ------------------------------------------------------------------ versions
    @property
    def version(self) -> int:
        """The newest installed weight version (what unpinned calls use)."""
        return next(reversed(self._models))

    @property
    def versions(self) -> list[int]:
        return list(self._models)

    @property
    def running(self) -> int:
        """Calls in the running batch."""
        return self._running()

    @property
    def waiting(self) -> int:
        """Calls waiting for a free row."""
        return sum(1 for call in self._pending if not call.future.done())

    def _load(
        self, state_dict: Mapping[str, torch.Tensor], into: torch.nn.Module | None = None
    ) -> torch.nn.Module:
        """Load weights into ``into`` (an evicted model) or a copy of the template.

        A copy, not a freshly built model: building draws initial weights from torch's
        global RNG, which a refit (in the engine's thread) must not touch.
        """
        model = into if into is not None else copy.deepcopy(self._template)
        try:
            model.load_state_dict(dict(state_dict))
        except (RuntimeError, KeyError) as error:
            raise RefitError(f"weights do not fit the policy model: {error}") from error
        return model

    async def refit(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Install ``version``; running unpinned calls switch to it at their next token.

        Idempotent: a refit to the newest installed version with the weights it already
        holds changes nothing (a trainer resumed at version 0 syncs workers that started at
        version 0; a retried refit). The same version with other weights, or an older
        version, is refused: one version number must always mean one set of weights.
        """
        if self._closed:
            raise EngineClosedError("generation engine is stopped")
        if version <= self.version:
            await self._confirm_installed(state_dict, version)
            return
        loop = asyncio.get_running_loop()
        spare = self._spare.pop() if self._spare else None
        try:
            model = await loop.run_in_executor(
                self._executor_or_start(), self._load, state_dict, spare
            )
        except RefitError:
            if spare is not None:
                self._spare.append(spare)
            raise
        if version <= self.version:  # a concurrent refit won
            if len(self._spare) < 2:
                self._spare.append(model)
            await self._confirm_installed(state_dict, version)
            return
        self._models[version] = model
        self._evict()
        logger.info("installed weight version %d (kept: %s)", version, self.versions)
        self._wake.set()

    async def _confirm_installed(
        self, state_dict: Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Return if ``version`` is the newest installed one and holds ``state_dict``."""
        if version == self.version:
            model = self._models[version]
            loop = asyncio.get_running_loop()
            same = await loop.run_in_executor(
                self._executor_or_start(), _same_weights, model, state_dict
            )
            if not same:
                raise RefitError(
                    f"refit to version {version} but version {version} is installed "
                    "with other weights"
                )
            if version == self.version:  # no newer refit landed while comparing
                logger.info("weight version %d is already installed", version)
                return
        raise RefitError(f"refit to version {version} but version {self.version} is installed")

    def _evict(self) -> None:
        in_use = {call.request.weight_version for call in self._pending if call.pinned}
        in_use |= {version for version, group in self._groups.items() if group.calls}
        for version in list(self._models):
            if len(self._models) <= self.keep_versions:
                break
            if version != self.version and version not in in_use:
                evicted = self._models.pop(version)
                self._groups.pop(version, None)
                if len(self._spare) < 2:
                    self._spare.append(evicted)

    # ------------------------------------------------------------------ calls
    def validate(self, request: GenerationRequest) -> None:
        """Raise ``InvalidRequestError``/``UnknownVersionError`` for a call that cannot run."""
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidRequestError("prompt_token_ids must not be empty")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids holds ids outside the vocabulary (0..{self.vocab_size - 1}): "
                f"{bad[:5]}"
            )
        if len(prompt) >= self.cfg.max_seq_len:
            raise InvalidRequestError(
                f"prompt of {len(prompt)} tokens leaves no room under max_seq_len "
                f"{self.cfg.max_seq_len}"
            )
        if request.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {request.max_tokens}")
        if request.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {request.temperature}")
        pinned = request.weight_version
        if pinned is not None and pinned not in self._models:
            if pinned > self.version:
                raise UnknownVersionError(
                    f"weight_version {pinned} is not installed yet (latest is {self.version})"
                )
            raise UnknownVersionError(
                f"weight_version {pinned} is no longer held (kept versions: {self.versions})"
            )

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one call to completion; it joins the running batch at the next step."""
        if self._closed:
            raise EngineClosedError("generation engine is stopped")
        self.validate(request)
        loop = asyncio.get_running_loop()
        seed = request.seed if request.seed is not None else self._rng.getrandbits(64)
        call = _Call(
            request=request,
            future=loop.create_future(),
            rng=random.Random(seed),
            tokens=list(request.prompt_token_ids),
        )
        self._pending.append(call)
        self._ensure_loop()
        self._wake.set()
        result = await call.future
        self.capture.record(request, result)
        return result

    # ------------------------------------------------------------------ loop
    def _executor_or_start(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="generation")
        return self._executor

    @property
    def idle(self) -> bool:
        """The step loop sleeps: no decode step runs or is about to (it wakes on a call)."""
        return self.rested_s() is not None

    def rested_s(self) -> float | None:
        """Seconds the step loop has slept for want of calls (infinite if it never ran or
        has stopped); None while it decodes."""
        if self._loop_task is None or self._loop_task.done():
            return float("inf")
        if not self._idle.is_set():
            return None
        return time.monotonic() - self._idle_since

    async def until_idle(self, timeout_s: float, quiet_s: float = 0.0) -> bool:
        """Wait (at most ``timeout_s``) for a moment between calls when the step loop has
        slept for ``quiet_s``; True if it has on return. Every decode step of a threaded
        engine is a turn of the caller's event loop, and its tensor work needs the
        interpreter lock for Python's share of each op: work the caller does meanwhile (a
        snapshot's commit, cut and write) delays every running call, and is free between
        them. ``quiet_s`` tells a pause inside a burst of calls (the next one is on its way)
        from the end of the burst."""
        with contextlib.suppress(TimeoutError):  # asyncio.timeout: a cancel is never lost
            async with asyncio.timeout(timeout_s):
                while True:
                    rested = self.rested_s()
                    if rested is not None and rested >= quiet_s:
                        return True
                    if rested is None:
                        await self._idle.wait()  # in this task: it goes on when the loop parks
                    else:
                        await asyncio.sleep(quiet_s - rested)
        rested = self.rested_s()
        return rested is not None and rested >= quiet_s

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name="generation-engine"
            )

    def _running(self) -> int:
        return sum(len(group.calls) for group in self._groups.values())

    def _schedule(self) -> None:
        """Admit pending calls and move unpinned calls onto the newest version."""
        latest = self.version
        for version, group in list(self._groups.items()):
            if version == latest:
                continue
            for call in [c for c in group.calls if not c.pinned]:
                group.remove(call)
                self._group(latest).add(call)
                call.version = latest
        still_pending: list[_Call] = []
        for call in self._pending:
            if call.future.done():
                continue
            if self._running() >= self.max_running:
                still_pending.append(call)
                continue
            pinned = call.request.weight_version
            version = latest if pinned is None else pinned
            if version not in self._models:  # evicted while it waited
                call.future.set_exception(
                    UnknownVersionError(f"weight_version {version} is no longer held")
                )
                continue
            self._group(version).add(call)
            call.version = version
        self._pending = still_pending
        self._evict()

    def _group(self, version: int) -> _Group:
        group = self._groups.get(version)
        if group is None:
            model: PolicyModel = self._models[version]  # type: ignore[assignment]
            group = self._groups[version] = _Group(model, self.device)
        return group

    async def _run(self) -> None:
        """The step loop; if it breaks (a bug), fail every call instead of hanging them."""
        try:
            await self._steps()
        except Exception as error:
            logger.exception("generation loop failed; failing every call")
            calls = list(self._pending) + [c for g in self._groups.values() for c in g.calls]
            self._pending.clear()
            self._groups.clear()
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(GenerationError(f"generation loop failed: {error}"))

    async def _steps(self) -> None:
        loop = asyncio.get_running_loop()
        executor = self._executor_or_start()
        while not self._closed:
            self._schedule()
            work = [(v, g) for v, g in self._groups.items() if g.calls]
            if not work:
                self._wake.clear()
                if self._pending:
                    continue
                self._idle_since = time.monotonic()
                self._idle.set()
                await self._wake.wait()
                self._idle.clear()
                continue
            # Draw the uniforms here, in call order, so sampling is reproducible per call.
            plans = [(version, group, list(group.calls)) for version, group in work]
            uniforms = {id(c): c.rng.random() for _, _, calls in plans for c in calls}
            try:
                if self.threaded:
                    outputs = await loop.run_in_executor(executor, self._compute, plans, uniforms)
                else:
                    outputs = self._compute(plans, uniforms)
            except Exception as error:
                logger.exception("generation step failed; failing its calls")
                for _, group, calls in plans:
                    for call in calls:
                        group.remove(call)
                        if not call.future.done():
                            call.future.set_exception(
                                GenerationError(f"generation step failed: {error}")
                            )
                continue
            self.steps += 1
            if not self.threaded:
                await asyncio.sleep(0)  # let requests in and responses out between steps
            for (version, group, calls), (tokens, logps) in zip(plans, outputs, strict=True):
                for call, token, logp in zip(calls, tokens, logps, strict=True):
                    self._advance(group, version, call, token, logp)

    def _advance(self, group: _Group, version: int, call: _Call, token: int, logp: float) -> None:
        call.cached = len(call.tokens)
        call.tokens.append(token)
        call.generated.append(token)
        call.logprobs.append(logp)
        call.versions.append(version)
        self.tokens_generated += 1
        if call.future.done():  # the caller went away (cancelled)
            call.finish_reason = "cancelled"
        elif token in self.stop_ids:
            call.finish_reason = "stop"
        elif len(call.generated) >= call.request.max_tokens or (
            len(call.tokens) >= self.cfg.max_seq_len
        ):
            call.finish_reason = "length"
        if call.finish_reason is None:
            return
        group.remove(call)
        if not call.future.done():
            call.future.set_result(
                GenerationResult(
                    token_ids=call.generated,
                    logprobs=call.logprobs,
                    weight_versions=call.versions,
                    finish_reason=call.finish_reason,
                )
            )

    def _compute(
        self, plans: list[tuple[int, _Group, list[_Call]]], uniforms: dict[int, float]
    ) -> list[tuple[list[int], list[float]]]:
        """One step for every group (worker thread): next-token logits, then sampling."""
        out: list[tuple[list[int], list[float]]] = []
        with torch.inference_mode():
            for _, group, calls in plans:
                logits = self._group_logits(group, calls)
                out.append(
                    sample_rows(
                        logits,
                        [c.request.temperature for c in calls],
                        [uniforms[id(c)] for c in calls],
                    )
                )
        return out

    def _group_logits(self, group: _Group, calls: list[_Call]) -> torch.Tensor:
        """Next-token logits [n, V] for rows 0..n-1; rows with new tokens are prefilled."""
        model, cache = group.model, group.cache
        if self.batch_invariant:
            rows = [self._rows_logits(model, cache, calls, i, i + 1) for i in range(len(calls))]
            return torch.cat(rows)
        # Decoding rows (one new token) and prefilling rows (new or moved calls, appended
        # last) are computed in contiguous runs, each a slice of the cache without copies.
        parts = []
        lo = 0
        while lo < len(calls):
            decoding = len(calls[lo].tokens) - calls[lo].cached == 1
            hi = lo + 1
            while hi < len(calls) and (len(calls[hi].tokens) - calls[hi].cached == 1) == decoding:
                hi += 1
            parts.append(self._rows_logits(model, cache, calls, lo, hi))
            lo = hi
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _rows_logits(
        self, model: PolicyModel, cache: torch.Tensor, calls: list[_Call], lo: int, hi: int
    ) -> torch.Tensor:
        rows = calls[lo:hi]
        news = [c.tokens[c.cached :] for c in rows]
        width = max(len(n) for n in news)
        padded = [n + [0] * (width - len(n)) for n in news] if width > 1 else news
        ids = torch.tensor(padded, dtype=torch.long, device=self.device)
        start = torch.tensor([c.cached for c in rows], dtype=torch.long, device=self.device)
        logits = model.forward_cached(ids, start, cache[:, :, lo:hi])
        if width == 1:
            return logits[:, 0]
        last = torch.tensor([len(n) - 1 for n in news], device=self.device)
        return logits[torch.arange(len(rows), device=self.device), last]

    async def stop(self) -> None:
        """Fail every waiting and running call and stop the loop and its thread."""
        self._closed = True
        self._wake.set()
        self._idle.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        calls = list(self._pending) + [c for g in self._groups.values() for c in g.calls]
        for call in calls:
            if not call.future.done():
                call.future.set_exception(EngineClosedError("generation engine stopped"))
        self._pending.clear()
        self._groups.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
