"""A re-admission probe that hangs does not hold back the replica's re-admission.

In the turn-level e2e a replacement Gym listened ~0.6 s after the trainer read its address,
yet was re-admitted ~2 s after that read: the first ``/healthz`` probe was sent before the
new pod's address took connections and hung until its timeout, and the watch sent no other
probe meanwhile. Now a round of probes starts every period without waiting for the last.
Here the replica's first ``/healthz`` never answers (the probe's timeout is made far longer
than the bound that catches a hang) and the later ones do.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from rolloutrun_runtime.algorithms import gym_client
from rolloutrun_runtime.algorithms.gym_client import GymClient, GymUnreachableError
from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.http import serve_app
from tests.support.data_plane import TOKEN

#: Bound that only catches a hang (never re-admitted), never timed.
HANG_BOUND_S = 60


async def test_a_hanging_probe_does_not_hold_back_re_admission(monkeypatch) -> None:
    monkeypatch.setattr(gym_client, "PROBE_TIMEOUT_S", 600.0)
    probes: list[int] = []
    hang = asyncio.Event()
    hanging = [False]  # from the watch's first probe on

    async def healthz(request: web.Request) -> web.Response:
        probes.append(1)
        if hanging[0]:
            hanging[0] = False
            await hang.wait()  # the first probe: its address took no connection yet
        return web.json_response({"instance_id": "gym-0", "capabilities": []})

    app = web.Application()
    app.router.add_get(HEALTHZ_ROUTE, healthz)
    runner, url = await serve_app(app)
    url = str(url).rstrip("/")
    client = GymClient([url], timeout_s=30, max_seq_len=32, overhead=OverheadClock(),
                       token=TOKEN)  # fmt: skip
    await client.open()
    watch = None
    try:
        assert not client.outages.down(url)
        client.outages.unreachable(url, GymUnreachableError(url, "lost"))
        probes.clear()
        hanging[0] = True  # the next probe (the watch's first) hangs
        watch = asyncio.ensure_future(client.watch_members(None, period_s=0.02))

        async def readmitted() -> None:
            while client.outages.down(url):
                await asyncio.sleep(0.02)

        await asyncio.wait_for(readmitted(), HANG_BOUND_S)
        assert len(probes) >= 2 and not hang.is_set()
    finally:
        hang.set()
        if watch is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        await client.close()
        await runner.cleanup()
