"""Copy-on-write maps: a frozen view of a dict in time proportional to what changed.

Why: a rollout snapshot's exclusive cut holds every pump while it copies the rollout state,
and at 10,000 buffered groups a plain ``dict(...)`` of the data plane, the ledger's group
texts, the replay buffer and the finalizer results is most of the cut's CPU. A
:class:`CowMap` is a ``dict`` (reads run at C speed) that, once a view was taken, logs each
key it changes; :meth:`CowMap.view` then costs one swap of that log, and the view builds its
dict (the previous view's, with the log applied) when it is first read, after the cut, off
the event loop. The view equals ``dict(map)`` at the moment it was taken, order included:
a key deleted and inserted again moves to the end, as in a ``dict``.

The log is bounded: once it holds more keys than the map (plus a margin) the map forgets
its views and the next view copies it whole, so an unread chain never costs more memory
than one copy. :meth:`CowMap.prime` takes that whole copy ahead of the cut.
Values are shared, never copied: the maps hold immutable values or values replaced, never
mutated (the data plane's rows, the ledger's JSON texts, frozen records).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: Log entries: the key's value changed in place; it was added at the end; it is gone.
_UPDATE, _ADD, _GONE = 0, 1, 2
#: Keys a log may hold beyond the map's size before the map stops logging.
LOG_MARGIN = 64

_ABSENT: Any = object()
_materialize_lock = threading.Lock()


class CowView(Generic[K, V]):
    """A map as it was when :meth:`CowMap.view` took it; :meth:`mapping` builds the dict."""

    __slots__ = ("_changes", "_full", "_parent")

    def __init__(
        self,
        *,
        full: dict[K, V] | None = None,
        parent: CowView[K, V] | None = None,
        changes: dict[K, tuple[int, Any]] | None = None,
    ) -> None:
        self._full = full
        self._parent = parent
        self._changes = changes

    @property
    def changed(self) -> int:
        """Keys logged since the previous view (0 for a whole copy)."""
        return len(self._changes) if self._changes is not None else 0

    def mapping(self) -> dict[K, V]:
        """The dict at the view's moment (built once; share it, do not mutate it)."""
        if self._full is not None:
            return self._full
        with _materialize_lock:
            if self._full is None:
                self._full = _apply_chain(self)
                self._parent = self._changes = None
        return self._full


def _apply_chain(view: CowView[K, V]) -> dict[K, V]:
    """The nearest built ancestor's dict with every later log applied, in order.

    When that ancestor is the direct parent and nothing but this view can reach it (its
    capture was written and dropped: the steady state of one snapshot after another), its
    dict is taken over and changed in place: building costs the log, and no new dict of
    every entry is left for the cyclic GC to traverse while young.
    """
    chain: list[dict[K, tuple[int, Any]]] = []
    node: CowView[K, V] | None = view
    while node is not None and node._full is None:
        assert node._changes is not None
        chain.append(node._changes)
        node = node._parent
    if node is None:
        raise RuntimeError("a copy-on-write view lost its base")
    direct = node is view._parent
    del node  # no reference of this frame's own when counting the parent's holders
    if direct and _holders(view) == _SOLE_HOLDERS:
        parent = view._parent
        assert parent is not None and parent._full is not None
        rows, parent._full = parent._full, None  # unreachable once this view drops its link
        del parent
    else:
        rows = dict(_built_base(view))
    for changes in reversed(chain):
        for key, (kind, value) in changes.items():
            if kind == _UPDATE:
                rows[key] = value
            else:
                rows.pop(key, None)
                if kind == _ADD:
                    rows[key] = value
    return rows


def _built_base(view: CowView[K, V]) -> dict[K, V]:
    node = view
    while node._full is None:
        assert node._parent is not None
        node = node._parent
    return node._full


def _holders(view: CowView[Any, Any]) -> tuple[int, int]:
    """References to ``view``'s parent and to the parent's dict, as counted from here."""
    parent = view._parent
    assert parent is not None
    return sys.getrefcount(parent), sys.getrefcount(parent._full)


def _calibrate() -> tuple[int, int]:
    """``_holders`` of a view that alone holds its parent, whose dict nothing else holds
    (counted the same way, so the interpreter's own references cancel out)."""
    child: CowView[int, int] = CowView(parent=CowView(full={}), changes={})
    return _holders(child)


class CowMap(dict[K, V]):
    """A ``dict`` whose :meth:`view` costs O(keys changed since the previous view)."""

    __slots__ = ("_last", "_log")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last: CowView[K, V] | None = None
        self._log: dict[K, tuple[int, Any]] = {}

    # ------------------------------------------------------------------ views
    def prime(self) -> None:
        """Copy the map whole now (ahead of a cut) unless a view already bases the log."""
        if self._last is None:
            self._last = CowView(full=dict(self))
            self._log = {}

    def view(self) -> CowView[K, V]:
        """The map as it is now: the log since the previous view (a whole copy the first
        time, or after the log outgrew the map)."""
        if self._last is None:
            view: CowView[K, V] = CowView(full=dict(self))
        else:
            view = CowView(parent=self._last, changes=self._log)
        self._last, self._log = view, {}
        return view

    @property
    def logging(self) -> bool:
        """Whether changes are logged (a view was taken and the log has not overflowed)."""
        return self._last is not None

    # ------------------------------------------------------------------ the log
    def _set(self, key: K, value: V) -> None:
        before = self._log.get(key, _ABSENT)
        if before is _ABSENT:
            self._log[key] = (_UPDATE if dict.__contains__(self, key) else _ADD, value)
        elif before[0] == _GONE:
            del self._log[key]  # inserted again: to the end, as the dict moves it
            self._log[key] = (_ADD, value)
        else:
            self._log[key] = (before[0], value)  # same place in the dict, new value
        self._check_size()

    def _gone(self, key: K) -> None:
        self._log.pop(key, None)
        self._log[key] = (_GONE, None)
        self._check_size()

    def _check_size(self) -> None:
        if len(self._log) > dict.__len__(self) + LOG_MARGIN:
            self._last, self._log = None, {}  # the next view copies the map whole

    # ------------------------------------------------------------------ dict mutators
    def __setitem__(self, key: K, value: V) -> None:
        if self._last is not None:
            self._set(key, value)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: K) -> None:
        dict.__delitem__(self, key)
        if self._last is not None:
            self._gone(key)

    def pop(self, key: K, *default: Any) -> Any:
        if dict.__contains__(self, key):
            value = dict.pop(self, key)
            if self._last is not None:
                self._gone(key)
            return value
        return dict.pop(self, key, *default)

    def popitem(self) -> tuple[K, V]:
        key, value = dict.popitem(self)
        if self._last is not None:
            self._gone(key)
        return key, value

    def setdefault(self, key: K, default: Any = None) -> Any:
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        self[key] = default
        return default

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Mapping[K, V] | Iterable[tuple[K, V]]) -> CowMap[K, V]:  # type: ignore[override,misc]
        self.update(other)
        return self

    def clear(self) -> None:
        dict.clear(self)
        self._last, self._log = None, {}

    def __reduce__(self) -> Any:  # copy.copy/deepcopy: a new map, not logging
        return (CowMap, (dict(self),))


#: What ``_holders`` counts when nothing but the view reaches its parent and that dict.
_SOLE_HOLDERS = _calibrate()
