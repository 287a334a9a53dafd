"""While a Gym replica is down, the trainer reads the members' addresses at a gentle pace.

Each read is a call on the trainer's one Lease pipe (afresh: an API read), and the fence
before every trainer checkpoint and snapshot commit waits behind it. Read every 0.1 s (the
re-admission probes' period) while a replica was down, the reads held the pipe and the fences
queued behind them: in the bench's turn-level runs ~2.4 s of fence waiting in the 10 s after
a Gym's loss (py-spy), the train steps held back with them. Here a real replica is lost (its
server closed), the watch runs with its defaults, and the reads and the probes are counted:
the probes still try the lost address every 0.1 s; the reads come at most every 0.5 s.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from rolloutrun_runtime.algorithms.gym_client import (
    MEMBERS_READ_PERIOD_S,
    GymClient,
    GymUnreachableError,
)
from rolloutrun_runtime.contract.pod import MemberEndpoint
from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.http import serve_app
from tests.support.data_plane import TOKEN

WATCHED_S = 1.6


async def test_a_down_replica_is_probed_often_and_its_address_read_gently() -> None:
    probes: list[float] = []
    lost = [False]

    async def healthz(request: web.Request) -> web.Response:
        if not lost[0]:
            return web.json_response({"instance_id": "gym-0"})
        probes.append(time.monotonic())
        return web.json_response({"instance_id": "gym-0"}, status=503)  # still starting

    app = web.Application()
    app.router.add_get(HEALTHZ_ROUTE, healthz)
    runner, url = await serve_app(app)
    url = str(url).rstrip("/")
    reads: list[bool] = []

    def endpoints(fresh: bool) -> dict[int, MemberEndpoint]:
        reads.append(fresh)
        return {}  # the operator has not written a replacement yet

    client = GymClient([url], timeout_s=30, max_seq_len=32, overhead=OverheadClock(),
                       token=TOKEN)  # fmt: skip
    await client.open()
    lost[0] = True
    client.outages.unreachable(url, GymUnreachableError(url, "lost"))
    watch = asyncio.ensure_future(client.watch_members(endpoints))
    try:
        await asyncio.sleep(WATCHED_S)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await client.close()
        await runner.cleanup()
    assert reads and all(reads)  # afresh while the replica is down
    assert len(reads) <= WATCHED_S / MEMBERS_READ_PERIOD_S + 1  # 16 at the probes' 0.1 s
    assert len(probes) >= 5  # the probes keep their 0.1 s: re-admission is not slowed
