"""The generation service over real HTTP: versions across refits, pinning, seeds, capture."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import torch

from rolloutrun_runtime.contract.run_config import PolicyConfig
from rolloutrun_runtime.policy.engine import EngineClosedError
from rolloutrun_runtime.policy.generation import (
    GenerationEngine,
    GenerationRequest,
    RefitError,
    build_generation_app,
    serve_app,
)
from rolloutrun_runtime.policy.model import build_model
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from tests.support.data_plane import HEADERS

CFG = PolicyConfig(device="cpu")
V = TOKENIZER.vocab_size


def constant_policy(seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Weights whose next-token distribution ignores the input and never picks eos.

    The final norm outputs a constant unit vector, so the logits are one head column: the
    test can check every reported logprob against the distribution of its version.
    """
    state = build_model(CFG, V, seed=seed).state_dict()
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed))
    logits[TOKENIZER.eos_id] = -30.0
    state["ln_f.weight"] = torch.zeros_like(state["ln_f.weight"])
    state["ln_f.bias"] = torch.zeros_like(state["ln_f.bias"])
    state["ln_f.bias"][0] = 1.0
    state["head.weight"] = torch.zeros_like(state["head.weight"])
    state["head.weight"][:, 0] = logits
    return state, torch.log_softmax(logits, -1)


class Served:
    def __init__(self, engine: GenerationEngine, url: str, http: aiohttp.ClientSession) -> None:
        self.engine, self.url, self.http = engine, url, http

    async def complete(self, expect: int = 200, **body: object) -> dict:
        body.setdefault("max_tokens", 8)
        async with self.http.post(self.url + "/v1/completions", json=body) as response:
            payload = await response.json()
            assert response.status == expect, payload
            return payload


async def _serve(engine: GenerationEngine) -> AsyncIterator[Served]:
    runner, url = await serve_app(build_generation_app(engine))
    try:
        async with aiohttp.ClientSession(headers=HEADERS) as http:
            yield Served(engine, url, http)
    finally:
        await runner.cleanup()


@pytest.fixture
async def const_server() -> AsyncIterator[Served]:
    state, _ = constant_policy(0)
    engine = GenerationEngine(CFG, V, TOKENIZER.eos_id, state, 0, keep_versions=2, seed=0)
    async for served in _serve(engine):
        yield served


@pytest.fixture
async def real_server() -> AsyncIterator[Served]:
    state = build_model(CFG, V, seed=1).state_dict()
    engine = GenerationEngine(CFG, V, TOKENIZER.eos_id, state, 5, seed=0)
    async for served in _serve(engine):
        yield served


def _assert_logprobs(result: dict, by_version: dict[int, torch.Tensor]) -> None:
    for token, logp, version in zip(
        result["token_ids"], result["logprobs"], result["weight_versions"], strict=True
    ):
        assert logp == pytest.approx(by_version[version][token].item(), abs=1e-5)


async def test_refit_mid_call_switches_unpinned_tokens_and_keeps_pinned(
    const_server: Served,
) -> None:
    engine = const_server.engine
    _, logp0 = constant_policy(0)
    state1, logp1 = constant_policy(1)
    prompt = TOKENIZER.encode("1+")
    unpinned = asyncio.create_task(
        const_server.complete(prompt_token_ids=prompt, max_tokens=120, rollout_id="r-un")
    )
    pinned = asyncio.create_task(
        const_server.complete(prompt_token_ids=prompt, max_tokens=120, weight_version=0)
    )
    while engine.tokens_generated < 20:
        await asyncio.sleep(0)
    await engine.refit(state1, 1)
    moving, fixed = await unpinned, await pinned

    assert moving["finish_reason"] == "length" and len(moving["token_ids"]) == 120
    versions = moving["weight_versions"]
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    _assert_logprobs(moving, {0: logp0, 1: logp1})
    assert fixed["weight_versions"] == [0] * 120
    _assert_logprobs(fixed, {0: logp0})

    # Captured per call: exactly what the response said.
    async with const_server.http.get(const_server.url + "/token-capture/rollouts/r-un") as r:
        capture = await r.json()
    assert capture["calls"] == [
        {
            "call_index": 0,
            "prompt_token_ids": prompt,
            "token_ids": moving["token_ids"],
            "logprobs": moving["logprobs"],
            "weight_versions": versions,
        }
    ]
    async with const_server.http.get(const_server.url + "/v1/weight_version") as r:
        assert (await r.json())["version"] == 1


async def test_pinned_versions_and_eviction(const_server: Served) -> None:
    engine = const_server.engine
    weights = constant_policy(1)[0]
    rng_before = torch.get_rng_state()
    await engine.refit(weights, 1)
    assert torch.equal(torch.get_rng_state(), rng_before), "a refit must not draw from torch's RNG"
    _, logp0 = constant_policy(0)
    old = await const_server.complete(prompt_token_ids=[5], weight_version=0)
    _assert_logprobs(old, {0: logp0})
    assert old["weight_versions"] == [0] * 8
    future = await const_server.complete(409, prompt_token_ids=[5], weight_version=7)
    assert "weight_version 7 is not installed yet" in future["error"]["message"]
    await engine.refit(constant_policy(2)[0], 2)  # keep_versions=2 evicts version 0
    gone = await const_server.complete(409, prompt_token_ids=[5], weight_version=0)
    assert "weight_version 0 is no longer held" in gone["error"]["message"]
    assert engine.versions == [1, 2]
    with pytest.raises(RefitError, match="version 2 is installed"):
        await engine.refit(constant_policy(3)[0], 2)
    with pytest.raises(RefitError, match="do not fit"):
        await engine.refit({"head.weight": torch.zeros(3, 3)}, 3)


async def test_a_refit_to_the_installed_version_and_weights_changes_nothing(
    const_server: Served,
) -> None:
    """A trainer resumed at version 0 syncs workers that started at version 0: the same
    version with the same weights is accepted and changes nothing, however often (it used
    to be refused, and the trainer crash-looped); other weights under it are refused."""
    engine = const_server.engine
    _, logp0 = constant_policy(0)
    for _ in range(2):
        await engine.refit(constant_policy(0)[0], 0)
    assert engine.versions == [0] and engine.version == 0
    again = await const_server.complete(prompt_token_ids=[5])
    _assert_logprobs(again, {0: logp0})
    with pytest.raises(RefitError, match="version 0 is installed with other weights"):
        await engine.refit(constant_policy(1)[0], 0)
    await engine.refit(constant_policy(1)[0], 1)
    await engine.refit(constant_policy(1)[0], 1)
    assert engine.versions == [0, 1]
    with pytest.raises(RefitError, match="refit to version 0 but version 1 is installed"):
        await engine.refit(constant_policy(0)[0], 0)


async def test_seeded_calls_reproduce_alone_and_in_a_busy_batch(real_server: Served) -> None:
    prompt = TOKENIZER.encode("3+4=")
    call: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "max_tokens": 30,
        "seed": 11,
        "temperature": 1.5,
    }
    first = await real_server.complete(**call)
    second = await real_server.complete(**call)
    busy = await asyncio.gather(
        *[real_server.complete(prompt_token_ids=[1, 7 + i], max_tokens=30) for i in range(6)],
        real_server.complete(**call),
    )
    other = await real_server.complete(**{**call, "seed": 12})
    assert first["token_ids"] == second["token_ids"] == busy[-1]["token_ids"]
    assert first["logprobs"] == pytest.approx(busy[-1]["logprobs"], abs=1e-5)
    assert first["logprobs"] == second["logprobs"]
    assert other["token_ids"] != first["token_ids"]
    assert set(first["weight_versions"]) == {5}
    greedy = [
        await real_server.complete(prompt_token_ids=prompt, temperature=0.0, max_tokens=20)
        for _ in range(2)
    ]
    assert greedy[0]["token_ids"] == greedy[1]["token_ids"]


async def test_batch_invariant_engine_gives_bit_identical_logprobs() -> None:
    state = build_model(CFG, V, seed=1).state_dict()
    engine = GenerationEngine(CFG, V, TOKENIZER.eos_id, state, 0, batch_invariant=True)
    try:
        call = GenerationRequest(prompt_token_ids=(1, 9, 10), max_tokens=25, seed=3)
        alone = await engine.generate(call)
        crowd = await asyncio.gather(
            *[
                engine.generate(GenerationRequest(prompt_token_ids=(1, 20 + i), max_tokens=25))
                for i in range(7)
            ],
            engine.generate(call),
        )
        assert crowd[-1] == alone
    finally:
        await engine.stop()


async def test_token_capture_lists_calls_and_releases(real_server: Served) -> None:
    base = real_server.url + "/token-capture/rollouts/"
    for index in (1, 0):
        await real_server.complete(
            prompt_token_ids=[1, 12 + index], rollout_id="roll-a", call_index=index
        )
    async with real_server.http.get(base + "roll-a") as response:
        calls = (await response.json())["calls"]
    assert [c["call_index"] for c in calls] == [0, 1]
    assert [c["prompt_token_ids"] for c in calls] == [[1, 12], [1, 13]]
    async with real_server.http.delete(base + "roll-a") as response:
        assert (await response.json())["released"] is True
    async with real_server.http.get(base + "roll-a") as response:
        assert response.status == 404
        assert "roll-a" in (await response.json())["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"prompt_token_ids": [1]}', 400, "max_tokens: Field required"),
        (b'{"prompt_token_ids": [1, 999], "max_tokens": 2}', 400, "outside the vocabulary"),
        (b'{"prompt_token_ids": [], "max_tokens": 2}', 400, "prompt_token_ids"),
        (b'{"prompt_token_ids": [1], "max_tokens": true}', 400, "max_tokens"),
        (b'{"prompt_token_ids": [1], "max_tokens": 2, "tempo": 1}', 400, "tempo"),
        (b'{"prompt_token_ids": [1], "max_tokens": 2, "temperature": -1}', 400, "temperature"),
        (b'{"prompt_token_ids": [' + b"3," * 127 + b'3], "max_tokens": 2}', 400, "no room"),
        (b'{"prompt_token_ids": [' + b"3," * 2_500_000 + b"3]}", 413, "byte limit"),
    ],
)
async def test_bad_requests_get_4xx_and_leave_the_server_serving(
    real_server: Served, body: bytes, status: int, needle: str
) -> None:
    headers = {"Content-Type": "application/json"}
    url = real_server.url + "/v1/completions"
    async with real_server.http.post(url, data=body, headers=headers) as response:
        payload = await response.json()
    assert response.status == status
    assert needle in payload["error"]["message"]
    ok = await real_server.complete(prompt_token_ids=[1, 5])
    assert len(ok["token_ids"]) == len(ok["logprobs"]) == len(ok["weight_versions"]) >= 1


async def test_unthreaded_engine_matches_threaded_engine() -> None:
    state = build_model(CFG, V, seed=2).state_dict()
    call = GenerationRequest(prompt_token_ids=(1, 9, 10), max_tokens=12, seed=5)
    results = []
    for threaded in (True, False):
        engine = GenerationEngine(CFG, V, TOKENIZER.eos_id, state, 0, threaded=threaded)
        try:
            results.append(await engine.generate(call))
        finally:
            await engine.stop()
    assert results[0] == results[1]


async def test_queueing_cancellation_and_versions_held_while_in_use() -> None:
    state0, logp0 = constant_policy(0)
    engine = GenerationEngine(
        CFG, V, TOKENIZER.eos_id, state0, 0, keep_versions=1, max_running=2, seed=1
    )
    try:
        # Five calls, two rows: the rest wait and join as rows free up.
        calls = [GenerationRequest(prompt_token_ids=(1, 5 + i), max_tokens=6) for i in range(5)]
        results = await asyncio.gather(*[engine.generate(c) for c in calls])
        assert [len(r.token_ids) for r in results] == [6] * 5

        # A cancelled call leaves the batch; the engine keeps serving.
        doomed = asyncio.create_task(
            engine.generate(GenerationRequest(prompt_token_ids=(1, 4), max_tokens=100))
        )
        while engine.tokens_generated < 31:
            await asyncio.sleep(0)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed

        # keep_versions=1, yet a running call pinned to version 0 keeps it installed.
        pinned = asyncio.create_task(
            engine.generate(
                GenerationRequest(prompt_token_ids=(1, 4), max_tokens=100, weight_version=0)
            )
        )
        while not pinned.done() and engine.tokens_generated < 60:
            await asyncio.sleep(0)
        await engine.refit(constant_policy(1)[0], 1)
        assert engine.versions == [0, 1]
        held = await pinned
        assert held.weight_versions == [0] * 100
        _assert_logprobs(held.to_json(), {0: logp0})
        await engine.refit(constant_policy(2)[0], 2)
        assert engine.versions == [2]
        assert engine.running == engine.waiting == 0
    finally:
        await engine.stop()
    with pytest.raises(EngineClosedError):
        await engine.generate(GenerationRequest(prompt_token_ids=(1,), max_tokens=1))


async def test_an_engine_is_idle_between_calls_and_its_wait_for_that_is_bounded() -> None:
    """What a snapshot waits for before its cut (rollout_checkpointing/test_generation_idle)."""
    state, _ = constant_policy(0)
    engine = GenerationEngine(CFG, V, TOKENIZER.eos_id, state, 0, seed=0)
    try:
        assert engine.idle and await engine.until_idle(0.0)  # never started: idle
        call = GenerationRequest(prompt_token_ids=(1, 4), max_tokens=100)
        running = asyncio.ensure_future(engine.generate(call))
        while engine.tokens_generated < 2:
            await asyncio.sleep(0)
        assert not engine.idle
        assert await engine.until_idle(0.001) is False  # bounded: a busy engine stays busy
        assert await engine.until_idle(30.0) is True  # the call ends: so does the wait
        assert running.done() and len(running.result().token_ids) == 100
    finally:
        await engine.stop()


async def test_an_engine_s_quiet_wait_tells_a_pause_between_calls_from_the_end_of_a_burst() -> None:
    """A snapshot waits for the engine to have rested for a while, not for its first pause:
    inside a burst of calls the next one is already on its way."""
    state, _ = constant_policy(0)
    engine = GenerationEngine(CFG, V, TOKENIZER.eos_id, state, 0, seed=0)
    call = GenerationRequest(prompt_token_ids=(1, 4), max_tokens=2)
    try:
        assert engine.rested_s() == float("inf")  # never started: quiet for ever
        await engine.generate(call)
        rested = engine.rested_s()
        assert engine.idle and rested is not None and rested < 1.0  # just parked
        assert await engine.until_idle(0.01, quiet_s=1.0) is False  # bounded, not quiet yet
        assert await engine.until_idle(5.0, quiet_s=0.05) is True
        assert (engine.rested_s() or 0.0) >= 0.05
        # a call during the wait starts the quiet over: the wait ends 0.2 s after it
        waiter = asyncio.ensure_future(engine.until_idle(5.0, quiet_s=0.2))
        await asyncio.sleep(0.1)
        await engine.generate(call)
        after_call = time.monotonic()
        assert await waiter is True
        assert time.monotonic() - after_call >= 0.19
    finally:
        await engine.stop()
    assert engine.rested_s() == float("inf")  # stopped
