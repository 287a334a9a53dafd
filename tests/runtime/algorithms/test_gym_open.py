"""A Gym replica that does not answer while the trainer opens its client is down, not fatal.

Real Gym servers on loopback (the Gym's own app: ``/healthz`` names its instance id). One of
two replicas is not listening when the client opens: the client opens on the survivor, a
resumed episode owned by the silent replica goes the way a lost owner's work goes (its call
ends unreachable, for the pump to redispatch), and once the replica serves it is re-admitted
under the instance id it names (never learned before). With no replica answering, open ends
after the unreachable budget with an error naming every replica. Before, open raised at the
first replica that did not answer, and the trainer ended (a restart, not a preemption).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.gym_client import (
    GymClient,
    GymOutageError,
    GymUnreachableError,
)
from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.http import serve_app
from tests.support.data_plane import TOKEN
from tests.support.run_configs import tiny_config

#: Bound that only catches a hang (a replica never re-admitted), never timed.
HANG_BOUND_S = 60


def _free_port() -> int:
    """A loopback port nothing listens on now (a replica not started yet)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _gym(tmp_path: Any, instance_id: str, port: int = 0) -> tuple[Any, str]:
    from rolloutrun_runtime.environments.gym import GymServer

    server = GymServer(instance_id, tiny_config(tmp_path), None, token=TOKEN)
    runner, url = await serve_app(server.app, port=port)
    return runner, str(url).rstrip("/")


def _client(urls: list[str], budget_s: float = 60.0) -> GymClient:
    return GymClient(
        urls,
        timeout_s=30,
        max_seq_len=32,
        overhead=OverheadClock(),
        unreachable_budget_s=budget_s,
        token=TOKEN,
    )


async def test_a_replica_not_listening_at_open_is_down_and_admitted_once_it_serves(tmp_path):
    survivor, survivor_url = await _gym(tmp_path / "a", "run-gym-0")
    port = _free_port()
    late_url = f"http://127.0.0.1:{port}"
    client = _client([survivor_url, late_url])
    late = None
    try:
        await client.open()  # before: GymUnavailableError "... is unhealthy"
        assert client.outages.down(late_url) and not client.outages.down(survivor_url)
        assert [client.pick(None).url for _ in range(4)] == [survivor_url] * 4
        assert client.pick("run-gym-0").url == survivor_url
        # A resumed episode owned by the replica that never answered: its call finds the
        # owner down, as a lost owner's does while running (the pump redispatches it).
        owned = client.pick("run-gym-1")
        assert (owned.url, owned.instance_id) == (late_url, "run-gym-1")
        with pytest.raises(GymUnreachableError):
            await client.run_episode(
                owned, EnvironmentEpisode("r0", 1), 1, "http://127.0.0.1:9/v1", {}
            )

        late, _ = await _gym(tmp_path / "b", "run-gym-1", port=port)
        watch = asyncio.ensure_future(client.watch_members(None, period_s=0.02))
        try:

            async def admitted() -> None:
                while client.outages.down(late_url):
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(admitted(), HANG_BOUND_S)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        # Its id is the one it named, learned now (it was never compared with a guess).
        assert client.replicas[1].instance_id == "run-gym-1"
        assert client.pick("run-gym-1") is client.replicas[1]
        assert {client.pick(None).url for _ in range(4)} == {survivor_url, late_url}
    finally:
        await client.close()
        await survivor.cleanup()
        if late is not None:
            await late.cleanup()


async def test_open_with_no_replica_answering_ends_after_the_budget_naming_them():
    urls = [f"http://127.0.0.1:{_free_port()}", f"http://127.0.0.1:{_free_port()}"]
    client = _client(urls, budget_s=0.5)
    with pytest.raises(GymOutageError) as none:
        await asyncio.wait_for(client.open(), HANG_BOUND_S)
    message = str(none.value)
    assert "no Gym replica answered /healthz" in message
    assert "gymUnreachableSeconds 0.5" in message
    assert all(url in message for url in urls)
    assert client._session is None  # closed on the way out


async def test_a_replica_answering_as_another_replicas_id_is_not_admitted(tmp_path):
    first, first_url = await _gym(tmp_path / "a", "run-gym-0")
    port = _free_port()
    client = _client([first_url, f"http://127.0.0.1:{port}"])
    twin = None
    try:
        await client.open()
        twin, _ = await _gym(tmp_path / "b", "run-gym-0", port=port)  # a misconfigured copy
        assert await client.readmit() == []
        assert "the id of another replica" in client._unanswered[client.replicas[1].url]
    finally:
        await client.close()
        await first.cleanup()
        if twin is not None:
            await twin.cleanup()


async def test_a_replacement_admitted_after_open_readdresses_the_environment_checkpoint(
    tmp_path,
):
    """Turn level: the environment checkpoint keys a replica silent at open by its pod id
    (``<run>-gym-<i>``, at its first address); its replacement serves at a new one. The
    client's ``on_replaced`` (the controller's hook to ``environment.readdress``) is told
    again once the replacement answers, under the id it names: the checkpoint then calls
    the replacement. Before, it was told only when readdressed, under the placeholder id
    (``gym-1``) the client had for a replica that never answered: the checkpoint kept
    calling the lost pod's address."""
    from rolloutrun_runtime.contract.pod import MemberEndpoint
    from rolloutrun_runtime.environments.checkpointing.nemo_gym import GymEnvironmentCheckpoint

    survivor, survivor_url = await _gym(tmp_path / "a", "run-gym-0")
    lost_url = f"http://127.0.0.1:{_free_port()}"
    client = _client([survivor_url, lost_url])
    environment = GymEnvironmentCheckpoint(
        {"run-gym-0": survivor_url, "run-gym-1": lost_url}, TOKEN
    )
    client.on_replaced = lambda r: environment.readdress(r.instance_id, r.url)
    replacement = None
    try:
        await client.open()
        replacement, new_url = await _gym(tmp_path / "b", "run-gym-1")
        assert client.readdress(MemberEndpoint(1, new_url, 1))
        assert [r.url for r in await client.readmit()] == [new_url]
        assert environment.endpoints == {"run-gym-0": survivor_url, "run-gym-1": new_url}
    finally:
        await client.close()
        await environment.close()
        await survivor.cleanup()
        if replacement is not None:
            await replacement.cleanup()
