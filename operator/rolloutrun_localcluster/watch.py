"""Watch streams: newline-delimited JSON events over one long HTTP response.

The semantics clients depend on (Kopf, the ``kubernetes`` client's ``Watch``, informers):

- no ``resourceVersion`` (or ``"0"``): synthetic ``ADDED`` events for the current state,
  then live events; with ``sendInitialEvents=true`` a ``BOOKMARK`` annotated
  ``k8s.io/initial-events-end`` closes the initial state;
- ``resourceVersion=N``: every event after N is replayed from the history, then live
  events; if N is older than the history, one ``ERROR`` event with a 410 ``Expired`` status;
- selector-filtered watches see an object entering the selection as ``ADDED`` and leaving
  it as ``DELETED``;
- ``allowWatchBookmarks=true``: ``BOOKMARK`` events carry a newer ``resourceVersion`` when
  nothing happens, so a reconnect does not replay (or expire);
- the stream ends after ``timeoutSeconds`` (default: a random 30-60 minutes, as real).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

from aiohttp import web

from .errors import ApiError
from .resources import ResourceType
from .selectors import FieldRequirement, Requirement
from .store import Event, Store, Watcher, render, transition
from .tables import TableStream, wants_table

logger = logging.getLogger(__name__)

INITIAL_EVENTS_END = "k8s.io/initial-events-end"


class WatchHub:
    """Serves watch requests and can end them all at once (to play a dropped connection)."""

    def __init__(self, store: Store, bookmark_interval: float = 5.0) -> None:
        self.store = store
        self.bookmark_interval = bookmark_interval
        self._active: set[Watcher] = set()

    @property
    def active(self) -> int:
        return len(self._active)

    def drop_all(self) -> int:
        """End every open watch stream, as a restarted API server or a lost connection does."""
        count = 0
        for watcher in list(self._active):
            watcher.queue.put_nowait(("__close__", None))  # type: ignore[arg-type]
            count += 1
        return count

    async def serve(
        self,
        request: web.Request,
        rtype: ResourceType,
        namespace: str | None,
        labels: list[Requirement],
        fields: list[FieldRequirement],
    ) -> web.StreamResponse:
        query = request.query
        version = query.get("resourceVersion", "")
        since = int(version) if version not in ("", "0") and version.isdigit() else None
        if version not in ("", "0") and not version.isdigit():
            since = 0
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        send_initial = query.get("sendInitialEvents") in ("true", "1")
        timeout = (
            float(query["timeoutSeconds"])
            if query.get("timeoutSeconds")
            else random.uniform(1800, 3600)
        )

        tables = None
        if wants_table(request.headers.get("Accept", "")):
            tables = TableStream(rtype, query.get("includeObject"))
        watcher = Watcher(rtype.storage_key, namespace, labels, fields)
        initial: list[dict[str, Any]] = []
        expired: ApiError | None = None
        if since is None:
            initial = self.store.list_objects(rtype, namespace, labels, fields)
        try:
            replay = self.store.watch(watcher, since)
        except ApiError as error:
            replay, expired = [], error
        start_rv = self.store.resource_version

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        if expired is None:
            self._active.add(watcher)
        try:
            await response.prepare(request)
            if expired is not None:
                await response.write(
                    json.dumps({"type": "ERROR", "object": expired.status()}).encode() + b"\n"
                )
                return response
            for obj in initial:
                if tables is not None:
                    await response.write(tables.line("ADDED", obj))
                    continue
                await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            if send_initial and bookmarks:
                await response.write(self._bookmark(rtype, start_rv, initial_end=True))
            for event in replay:
                seen = transition(
                    event.type, watcher.matches(event.old), watcher.matches(event.obj)
                )
                if seen is not None:
                    await response.write(_line(event, seen, rtype, tables))
            await self._stream(request, response, watcher, rtype, timeout, bookmarks, tables)
        except (ConnectionResetError, asyncio.CancelledError):
            logger.debug("watch of %s closed by the client", rtype.plural)
        finally:
            self._active.discard(watcher)
            self.store.unwatch(watcher)
        return response

    async def _stream(
        self,
        request: web.Request,
        response: web.StreamResponse,
        watcher: Watcher,
        rtype: ResourceType,
        timeout: float,
        bookmarks: bool,
        tables: TableStream | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        # Without bookmarks there is nothing to wake for but the deadline and the liveness
        # check: a bookmark time left in the past would make every wait zero (a busy loop).
        next_bookmark = loop.time() + self.bookmark_interval if bookmarks else float("inf")
        # One pending get() is kept across timeouts: cancelling a get() that has just been
        # handed an item (what asyncio.wait_for does on a timeout in Python 3.11) would
        # drop that event from the stream.
        getter: asyncio.Task[tuple[str, Event]] | None = None
        try:
            while True:
                now = loop.time()
                if now >= deadline:
                    return
                if request.transport is None or request.transport.is_closing():
                    return
                if getter is None:
                    getter = asyncio.ensure_future(watcher.queue.get())
                wait = min(deadline, next_bookmark, now + 1.0) - now
                done, _ = await asyncio.wait({getter}, timeout=max(wait, 0.0))
                if not done:
                    if loop.time() >= next_bookmark and watcher.queue.empty():
                        await response.write(self._bookmark(rtype, self.store.resource_version))
                        next_bookmark = loop.time() + self.bookmark_interval
                    continue
                seen, event = getter.result()
                getter = None
                if seen == "__close__":
                    return
                await response.write(_line(event, seen, rtype, tables))
        finally:
            if getter is not None:
                getter.cancel()

    @staticmethod
    def _bookmark(rtype: ResourceType, rv: int, initial_end: bool = False) -> bytes:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {INITIAL_EVENTS_END: "true"}
        obj = {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": meta}
        return json.dumps({"type": "BOOKMARK", "object": obj}).encode() + b"\n"


def _line(event: Event, seen: str, rtype: ResourceType, tables: TableStream | None) -> bytes:
    """One event as the watch asked for it: the object, or a one-row Table."""
    if tables is None:
        return event.line(seen, rtype.api_version)
    return tables.line(seen, render(event.obj, rtype.api_version))
