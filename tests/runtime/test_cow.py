"""Copy-on-write maps: a view equals ``dict(map)`` at its moment, order included, however
the map changed since and in whatever order the views are read; taking one costs the keys
changed since the previous view."""

from __future__ import annotations

import random
import threading

from rolloutrun_runtime.cow import LOG_MARGIN, CowMap, CowView


def _mutate(live: CowMap[int, int], model: dict[int, int], rng: random.Random) -> None:
    """One random change, applied to the map and to a plain dict alike."""
    op = rng.randrange(7)
    key = rng.randrange(40)
    value = rng.randrange(1000)
    if op < 3:
        live[key] = model[key] = value
    elif op == 3:
        assert live.pop(key, None) == model.pop(key, None)
    elif op == 4 and key in model:
        del live[key]
        del model[key]
    elif op == 5:
        assert live.setdefault(key, value) == model.setdefault(key, value)
    else:
        more = {rng.randrange(40): value, rng.randrange(40): value + 1}
        live.update(more)
        model.update(more)


def test_views_equal_the_dict_at_their_moment_order_included() -> None:
    rng = random.Random(7)
    live: CowMap[int, int] = CowMap({k: k for k in range(20)})
    model = dict(live)
    taken: list[tuple[CowView[int, int], list[tuple[int, int]]]] = []
    for _ in range(300):
        for _ in range(rng.randrange(6)):
            _mutate(live, model, rng)
        assert list(live.items()) == list(model.items())
        taken.append((live.view(), list(model.items())))
    # read newest first, then the rest shuffled: each view builds on its unread ancestors
    order = [len(taken) - 1, *rng.sample(range(len(taken) - 1), len(taken) - 1)]
    for index in order:
        view, expected = taken[index]
        assert list(view.mapping().items()) == expected, index


def test_a_view_costs_the_keys_changed_since_the_previous_one() -> None:
    live: CowMap[str, int] = CowMap({f"k{i}": i for i in range(10_000)})
    first = live.view()  # the first view copies the map whole
    assert first.changed == 0 and len(first.mapping()) == 10_000
    live["k17"] = -1
    live["new"] = 1
    del live["k3"]
    second = live.view()
    assert second.changed == 3
    assert live.view().changed == 0
    built = second.mapping()
    assert built["k17"] == -1 and "k3" not in built and list(built)[-1] == "new"
    assert first.mapping()["k17"] == 17  # the earlier view is unchanged


def test_a_key_deleted_and_inserted_again_moves_to_the_end() -> None:
    live: CowMap[str, int] = CowMap(a=1, b=2, c=3)
    live.view()
    del live["a"]
    live["d"] = 4
    live["a"] = 5
    live["b"] = 6  # in place
    assert list(live.view().mapping().items()) == [("b", 6), ("c", 3), ("d", 4), ("a", 5)]


def test_a_log_that_outgrows_the_map_is_dropped_and_the_next_view_copies_whole() -> None:
    live: CowMap[int, int] = CowMap({0: 0})
    live.view()
    for key in range(1, LOG_MARGIN + 10):
        live[key] = key
        del live[key]
    assert not live.logging
    view = live.view()
    assert view.changed == 0 and view.mapping() == {0: 0}
    assert live.logging


def test_prime_copies_ahead_so_the_view_holds_only_later_changes() -> None:
    live: CowMap[int, int] = CowMap({k: k for k in range(100)})
    live.prime()
    live[5] = 50
    view = live.view()
    assert view.changed == 1 and view.mapping() == {**{k: k for k in range(100)}, 5: 50}
    live.prime()  # a logging map keeps its base
    live[6] = 60
    assert live.view().changed == 1


def test_clear_and_popitem_are_logged_or_reset() -> None:
    live: CowMap[int, int] = CowMap({1: 1, 2: 2})
    live.view()
    assert live.popitem() == (2, 2)
    assert live.view().mapping() == {1: 1}
    live.clear()
    live[3] = 3
    assert live.view().mapping() == {3: 3}


def test_a_view_is_built_in_another_thread_while_the_map_changes() -> None:
    live: CowMap[int, int] = CowMap({k: k for k in range(5000)})
    live.view()
    for key in range(0, 5000, 7):
        live[key] = -key
    expected = dict(live)
    view = live.view()
    built: list[dict[int, int]] = []
    reader = threading.Thread(target=lambda: built.append(view.mapping()))
    reader.start()
    for key in range(5000):  # the live map goes on changing meanwhile
        live[key] = key * 2
    reader.join()
    assert built == [expected]


def test_views_read_one_after_another_stay_right_when_each_is_dropped() -> None:
    """The steady state: each view is read, written and dropped before the next is read, so
    the next one takes over its dict instead of copying it; every view is still exact."""
    rng = random.Random(3)
    live: CowMap[int, int] = CowMap({k: k for k in range(30)})
    model = dict(live)
    live.prime()
    for _ in range(200):
        for _ in range(rng.randrange(5)):
            _mutate(live, model, rng)
        view = live.view()
        assert list(view.mapping().items()) == list(model.items())
        del view


def test_a_parent_is_taken_over_only_when_nothing_else_holds_it_or_its_dict() -> None:
    from rolloutrun_runtime.cow import _SOLE_HOLDERS, _holders

    live: CowMap[int, int] = CowMap({1: 1})
    first = live.view()
    live[2] = 2
    second = live.view()
    assert _holders(second) != _SOLE_HOLDERS  # ``first`` is still held here
    held = first.mapping()
    del first
    assert _holders(second) != _SOLE_HOLDERS  # its dict is still held
    assert second.mapping() == {1: 1, 2: 2} and held == {1: 1}
    live[3] = 3
    third = live.view()
    assert _holders(third) != _SOLE_HOLDERS  # ``second`` is still held here
    del second
    assert _holders(third) == _SOLE_HOLDERS  # now only through ``third``: taken over
    assert third.mapping() == {1: 1, 2: 2, 3: 3} and held == {1: 1}
