"""A Gym lost while a turn-level snapshot calls its control plane ends that call at once.

Before, a snapshot's retire/prepare/commit call to a Gym pod that was just deleted waited
for the phase's deadline: the deleted pod's address never answers (no connection refused),
so the trainer's step stalled ~20 s on every Gym deletion at turn level (the turn-level
e2e's log: ``retire failed: TimeoutError()`` and ``step_time=21.15s``). Now the Gym client
tells the checkpoint when it finds a replica unreachable: its calls in flight end as that
replica unavailable to the phase (the path a failed replica already took), and none is sent
to it until it is readdressed. Here the Gym is a real socket that takes the request and
never answers; the phase's deadline is far beyond the bound that catches a hang.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rolloutrun_runtime.algorithms.gym_client import GymClient, GymUnreachableError
from rolloutrun_runtime.environments.checkpointing import EnvironmentEpisode
from rolloutrun_runtime.environments.checkpointing.nemo_gym import GymEnvironmentCheckpoint
from rolloutrun_runtime.metrics import OverheadClock

TOKEN = "lost"
#: Only catches a hang: the calls' own deadline is ten times longer.
HANG_BOUND_S = 60.0
FAR = 600.0


class SilentGym:
    """A loopback socket that reads each request and never answers (a gone pod's address)."""

    def __init__(self) -> None:
        self.requests = 0
        self.received = asyncio.Event()
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.read(4096):
            self.requests += 1
            self.received.set()
        await asyncio.Event().wait()  # never answers

    async def __aenter__(self) -> SilentGym:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


@pytest.fixture
async def silent() -> AsyncIterator[SilentGym]:
    async with SilentGym() as gym:
        yield gym


def _checkpoint(url: str) -> GymEnvironmentCheckpoint:
    return GymEnvironmentCheckpoint({"gym-0": url}, TOKEN, request_timeout_s=FAR)


async def test_a_call_in_flight_to_a_lost_gym_ends_as_that_gym_unavailable(
    silent: SilentGym,
) -> None:
    checkpoint = _checkpoint(silent.url)
    try:
        retire = [EnvironmentEpisode("r0", 0, "gym-0")]
        phase = asyncio.ensure_future(checkpoint.prepare("snap-1", time.time() + FAR, retire))
        await asyncio.wait_for(silent.received.wait(), HANG_BOUND_S)
        checkpoint.lost("gym-0", "Cannot connect to host")
        failed = await asyncio.wait_for(phase, HANG_BOUND_S)
    finally:
        await checkpoint.close()
    assert set(failed) == {"gym-0"}
    assert "lost mid-call" in failed["gym-0"]


async def test_a_lost_gym_gets_no_call_until_it_is_readdressed(silent: SilentGym) -> None:
    checkpoint = _checkpoint(silent.url)
    try:
        checkpoint.lost("gym-0", "Cannot connect to host")
        failed = await asyncio.wait_for(
            checkpoint.prepare("snap-1", time.time() + FAR), HANG_BOUND_S
        )
        assert "not sent" in failed["gym-0"] and silent.requests == 0
        checkpoint.readdress("gym-0", silent.url)  # answers again (re-admitted)
        again = asyncio.ensure_future(checkpoint.prepare("snap-2", time.time() + FAR))
        await asyncio.wait_for(silent.received.wait(), HANG_BOUND_S)
        assert silent.requests == 1 and not again.done()
        again.cancel()
        await asyncio.gather(again, return_exceptions=True)
    finally:
        await checkpoint.close()


async def test_the_gym_client_tells_the_checkpoint_once_per_outage(silent: SilentGym) -> None:
    client = GymClient([silent.url], timeout_s=FAR, max_seq_len=32, overhead=OverheadClock(),
                       token=TOKEN)  # fmt: skip
    replica = client.replicas[0]
    replica.instance_id, replica.identified = "gym-0", True
    checkpoint = _checkpoint(silent.url)
    told: list[str] = []

    def down(r: object, why: str) -> None:
        told.append(why)
        checkpoint.lost(replica.instance_id, why)

    client.on_down = down  # as the controller wires it
    try:
        phase = asyncio.ensure_future(checkpoint.prepare("snap-1", time.time() + FAR))
        await asyncio.wait_for(silent.received.wait(), HANG_BOUND_S)
        for _ in range(2):  # two siblings' /run found it unreachable: one outage
            client.outages.unreachable(replica.url, GymUnreachableError(replica.url, "refused"))
        failed = await asyncio.wait_for(phase, HANG_BOUND_S)
    finally:
        await checkpoint.close()
    assert len(told) == 1 and "refused" in told[0]
    assert set(failed) == {"gym-0"}
