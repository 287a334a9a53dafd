"""The runs' Leases, streamed by a raw label-selected watch beside Kopf's, held in memory.

Why not Kopf: at a thousand runs the trainers renew about 170 Leases a second. Through
Kopf's per-event machinery (a worker per object, an index handler and an event handler per
event, each with its own bookkeeping) that cost a third of a core, and a lost pod's event
waited behind the renewals: replacement p99 was 21 s at 1,000 runs. A renewal needs no
handler: it only moves the run's expiry deadline in memory (see :mod:`.watching`). Here
each event is one JSON decode and a few dictionary updates, handed to one callback; a pass
reads the run's Lease from :meth:`LeaseWatch.get` as it read Kopf's index. The watch yields
to the event loop after every event, so Kopf's pod stream (a lost pod) is never held behind
a burst of renewals.

The watch needs the same rights as Kopf's did (``list`` and ``watch`` on Leases, in the
watched namespaces or cluster-wide); it runs whether or not this operator holds the peering
lead: it only records, and the runs' daemons, which decide, run only while Kopf does.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp

from rolloutrun_operator import naming
from rolloutrun_operator.kube import RESOURCES, Credentials, Json, KubeError

logger = logging.getLogger(__name__)

#: How long one watch request lasts on the server before it is renewed (Kopf's setting).
WATCH_SECONDS = 300
#: Pause before the watch lists again after an error (the API server gone, a 410 Gone).
RETRY_SECONDS = 1.0

#: ``(namespace, lease or None: gone)`` of a run's Lease that changed, by run name.
LeaseCallback = Callable[[str, str, Json | None], None]


def lease_key(lease: Json) -> tuple[str, str] | None:
    """``(namespace, run)`` of a run's own Lease (named :func:`naming.lease_name` of its run
    label); None for any other labelled Lease."""
    meta = lease.get("metadata") or {}
    run = (meta.get("labels") or {}).get(naming.LABEL_RUN)
    if not run or meta.get("name") != naming.lease_name(run):
        return None
    return str(meta.get("namespace") or "default"), str(run)


def watch_paths(namespaces: Sequence[str]) -> list[tuple[str | None, str]]:
    """``(namespace or None: all, API path)`` of each Lease listing the operator watches."""
    leases = RESOURCES["Lease"]
    if not namespaces:
        return [(None, leases.path(None))]
    return [(namespace, leases.path(namespace)) for namespace in namespaces]


class LeaseWatch:
    """The runs' Leases by ``(namespace, run)``, kept current by one watch per path.

    Touched only on the operator's event loop. :attr:`ready` is set once every path has
    been listed (a pass must not take "no Lease yet" for "no Lease", as Kopf's indexes are
    filled before its handlers start)."""

    def __init__(
        self, credentials: Credentials, namespaces: Sequence[str], changed: LeaseCallback
    ) -> None:
        self.credentials = credentials
        self.paths = watch_paths(namespaces)
        self.changed = changed
        self.leases: dict[tuple[str, str], Json] = {}
        self.ready = asyncio.Event()
        self.events = 0
        """Lease events handled (initial listings included)."""
        self._listed: set[str] = set()

    def get(self, namespace: str, run: str) -> Json | None:
        return self.leases.get((namespace, run))

    def apply(self, event_type: str, lease: Json) -> None:
        """Record one watch event and tell the callback about the run's Lease."""
        key = lease_key(lease)
        if key is None:
            return
        self.events += 1
        if event_type == "DELETED":
            self.leases.pop(key, None)
            self.changed(key[0], key[1], None)
        else:
            self.leases[key] = lease
            self.changed(key[0], key[1], lease)

    async def run(self) -> None:
        """Follow every path until cancelled."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=WATCH_SECONDS + 60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._follow(session, ns, path) for ns, path in self.paths))

    async def _follow(
        self, session: aiohttp.ClientSession, namespace: str | None, path: str
    ) -> None:
        while True:
            try:
                version = await self._relist(session, namespace, path)
                await self._stream(session, path, version)
            except Exception as error:  # every failure is retried: the watch never ends
                logger.warning("the Lease watch of %s stopped (listing again): %s", path, error)
            await asyncio.sleep(RETRY_SECONDS)

    def _get(self, session: aiohttp.ClientSession, path: str, params: dict[str, str]) -> Any:
        headers = {"Accept": "application/json"}
        auth = self.credentials.authorization()
        if auth:
            headers["Authorization"] = auth
        url = self.credentials.host + path
        ssl = self.credentials.ssl_context
        return session.get(url, params=params, headers=headers, ssl=ssl)

    async def _relist(
        self, session: aiohttp.ClientSession, namespace: str | None, path: str
    ) -> str:
        """List the labelled Leases: record each, and each held one no longer listed as
        gone; returns the listing's ``resourceVersion``."""
        params = {"labelSelector": naming.LABEL_RUN}
        async with self._get(session, path, params) as response:
            text = await response.text()
            if response.status >= 400:
                raise KubeError(f"GET {path}: {response.status} {text[:200]}", response.status)
            listing = json.loads(text)
        items = list(listing.get("items") or [])
        listed = {lease_key(item) for item in items}
        for key in [k for k in self.leases if namespace in (None, k[0]) and k not in listed]:
            gone = self.leases[key]
            self.apply("DELETED", gone)
        for item in items:
            self.apply("ADDED", item)
        self._listed.add(path)
        if len(self._listed) == len(self.paths):
            self.ready.set()
        return str((listing.get("metadata") or {}).get("resourceVersion") or "")

    async def _stream(self, session: aiohttp.ClientSession, path: str, version: str) -> None:
        """Watch from ``version`` until the server says it is too old (410: list again)."""
        while True:
            params = {
                "watch": "1",
                "labelSelector": naming.LABEL_RUN,
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(WATCH_SECONDS),
            }
            async with self._get(session, path, params) as response:
                if response.status >= 400:
                    text = await response.text()
                    raise KubeError(
                        f"watch {path}: {response.status} {text[:200]}", response.status
                    )
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    kind, obj = str(event.get("type") or ""), event.get("object") or {}
                    if kind == "ERROR":
                        raise KubeError(
                            f"watch {path}: {obj.get('message', obj)}", obj.get("code", 0)
                        )
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind != "BOOKMARK":
                        self.apply(kind, obj)
                    await asyncio.sleep(0)  # a lost pod's event never waits behind a burst
