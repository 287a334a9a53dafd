"""The run's data-plane token for tests, and the trainer's side of the ``/policy`` handshake.

Why here: every Gym and generation server refuses to start without the run's bearer token
(``contract.pod.ENV_GYM_TOKEN``), and a Gym's ``/run`` may only name a generation address
the trainer announced. ``tests/conftest.py`` sets :data:`TOKEN` in the environment of every
test, so servers and clients built with defaults agree; tests that speak HTTP themselves
send :data:`HEADERS` and call :func:`announce` as the trainer's Gym client does.
"""

from __future__ import annotations

import aiohttp

from rolloutrun_runtime.contract.wire import GYM_POLICY_ROUTE
from rolloutrun_runtime.policy.http import bearer_headers

#: The data-plane token of every test (set as ``ENV_GYM_TOKEN`` by ``tests/conftest.py``).
TOKEN = "test-data-plane-token"
#: The header every data-plane call of a test sends.
HEADERS = bearer_headers(TOKEN)


async def announce(session: aiohttp.ClientSession, gym_url: str, policy_url: str) -> None:
    """Announce ``policy_url`` to the Gym at ``gym_url``, as the trainer does before ``/run``."""
    async with session.post(
        gym_url.rstrip("/") + GYM_POLICY_ROUTE,
        json={"policy_urls": [policy_url]},
        headers=HEADERS,
    ) as response:
        assert response.status == 200, await response.text()
