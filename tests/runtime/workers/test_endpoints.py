"""The generation endpoints given to the Gyms: a lost one is skipped until it answers again
or a refit drops it, and an attempt that finds none for the budget ends in a named error."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE
from rolloutrun_runtime.policy.http import serve_app
from rolloutrun_runtime.workers.endpoints import (
    PolicyEndpoints,
    PolicyOutageError,
    answers_healthz,
    choose,
)

#: Bound of a re-admission wait: a loop that never re-admits fails the test.
READMIT_LIMIT_S = 30


@dataclass
class _Workers:
    """The part of ``PolicyWorkers`` the endpoint set reads: where they serve now."""

    endpoints: list[str] = field(default_factory=list)


def test_rotation_skips_lost_endpoints_until_all_are_lost():
    urls = ["http://a", "http://b", "http://c"]
    assert [choose(urls, set(), t) for t in range(3)] == urls
    assert [choose(urls, {"http://b"}, t) for t in range(4)] == ["http://a", "http://c"] * 2
    assert choose(urls, set(urls), 4) == "http://b"  # every one lost: all given out
    with pytest.raises(ValueError, match="no generation endpoint"):
        choose([], set(), 0)


async def test_a_lost_endpoint_is_re_admitted_when_it_answers_or_dropped_at_a_refit():
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get(HEALTHZ_ROUTE, healthz)
    runner, live = await serve_app(app)
    gone = "http://127.0.0.1:9"
    workers = _Workers([live, gone])
    policies = PolicyEndpoints(workers, budget_s=60)
    try:
        assert await answers_healthz(live) and not await answers_healthz(gone)
        assert not policies.lost(gone, time.monotonic(), "refused")
        policies.mark_lost(live)  # a false alarm: it answers, and comes back
        assert policies.all_lost()
        async with asyncio.timeout(READMIT_LIMIT_S):
            while live in policies.down:
                await asyncio.sleep(0.05)
        assert {await policies.pick() for _ in range(4)} == {live}
        workers.endpoints = [live, "http://127.0.0.1:10"]  # a refit replaced the lost one
        await policies.pick()
        assert gone not in policies.down  # nothing to re-admit: its successor is given out
        assert {await policies.pick() for _ in range(4)} == set(workers.endpoints)
    finally:
        await policies.close()
        await runner.cleanup()


async def test_an_attempt_without_a_reachable_endpoint_for_the_budget_is_a_named_error():
    policies = PolicyEndpoints(_Workers(["http://a"]), budget_s=5)
    with pytest.raises(PolicyOutageError, match=r"gymUnreachableSeconds 5\b.*last: refused"):
        policies.lost("http://x", time.monotonic() - 6, "refused")


async def test_a_pick_while_no_worker_serves_waits_for_one_then_names_the_loss():
    workers = _Workers([])
    policies = PolicyEndpoints(workers, budget_s=0.2)
    with pytest.raises(PolicyOutageError, match="no generation worker served"):
        await policies.pick()
    policies.budget_s = 60
    waiting = asyncio.ensure_future(policies.pick())
    await asyncio.sleep(0)
    workers.endpoints.append("http://replacement")  # a refit admitted a replacement
    assert await asyncio.wait_for(waiting, READMIT_LIMIT_S) == "http://replacement"
