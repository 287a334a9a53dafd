"""``python -m bench.elastic --role worker --interleaved``: the worker rate inside one run.

Why: the worker arms of :mod:`bench.elastic_workers` are separate runs back to back, and
two of them differ before anything is deleted (last measured: the worst seed's disturbed
arm trained 141 steps in the 15 s before its first deletion against its undisturbed arm's
168, the same pods on the same cores): a ratio of such arms carries that drift. Here one run
per seed (worker pods and ``--standby`` standbys) alternates undisturbed (U) and disturbed
(D) segments in ABBA order (U D, D U, ...), so both share the run, its age and the machine:

- **U**: begins once the standby pool is full (the previous D's refills are ready: the wait
  is not timed), then ``2 * every`` seconds with nothing deleted.
- **D**: a worker pod whose actor serves is deleted at its start and ``every`` seconds later
  (:class:`bench.elastic_workers.Victims` picks it), then the segment goes on, timed, until
  the pool is full again: every deletion's cost, its refill pod's start included, falls in
  a D segment and none in a U one (a refill still starting would otherwise slow the next U
  and flatter the ratio).

The seed's ratio is the D segments' steps per minute over the U segments' (pooled), with
the per-pair ratios for its spread (:func:`bench.elastic_report.interleaved_rates`); each
deletion's outcome and time as the worker arms report them. Over the seeds: mean, spread,
worst seed and the goals (issue 14) on the worst seed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun

from .elastic import ReplacementWatch, _highest_step
from .elastic_report import abba_pairs, delete_watched, interleaved_rates
from .elastic_workers import (
    SETTLE_S,
    Victims,
    _pool_ready,
    _worker_document,
    _worker_replacements,
)
from .operator_recovery import wait


def interleaved_worker_seed(
    seed: int, work: Path, *, every: float, pairs: int, standby: int
) -> dict[str, Any]:
    """One run of seed ``seed`` whose segments alternate U and D (module docstring)."""
    if standby < 1:
        raise SystemExit("--role worker --interleaved needs --standby >= 1 (a pool to refill)")
    victims = Victims()
    deletions: list[tuple[float, str]] = []
    watches: list[ReplacementWatch] = []
    segments: list[tuple[str, int, float]] = []
    document = _worker_document(True, seed, standby)
    with EmbeddedRun(document, work / f"workers-interleaved-{seed}") as run:
        wait(lambda: _highest_step(run) >= 2, f"interleaved-{seed}: training", bound=600)
        k = seed
        for pair in abba_pairs(pairs):
            for kind in pair:
                wait(lambda: _pool_ready(run, standby, True, []), f"seed {seed}: pool", 600)
                start, first = time.time(), _highest_step(run)
                if kind == "D":
                    k = _disturb(run, every, standby, k, victims, deletions, watches)
                else:
                    time.sleep(2 * every)
                segments.append((kind, _highest_step(run) - first, time.time() - start))
        status = run.status()
        replaced = _worker_replacements(
            run, status, deletions, watches, picks=victims.picks, span=every
        )
    return seed_result(seed, segments, replaced, int(status.get("incarnation") or 0))


def seed_result(
    seed: int, segments: list[tuple[str, int, float]], replaced: dict[str, Any], incarnations: int
) -> dict[str, Any]:
    """A seed's report: the segments' rates and ratio, and the deletions' outcomes under the
    names :func:`bench.elastic_workers.worker_over_seeds` reads (the ``standby`` arm's)."""
    rates = interleaved_rates(segments)
    return {
        "seed": seed,
        **rates,
        "standby_vs_undisturbed": rates["elastic_vs_undisturbed"],
        "standby": replaced,
        "incarnations": incarnations,
    }


def _disturb(
    run: EmbeddedRun,
    every: float,
    standby: int,
    k: int,
    victims: Victims,
    deletions: list[tuple[float, str]],
    watches: list[ReplacementWatch],
) -> int:
    """A D segment: a serving worker pod deleted now and ``every`` seconds later, then on
    until the pool is full again (at most :data:`SETTLE_S` past the segment); returns the
    next pick's number."""
    start = time.time()
    for due in (start, start + every):
        time.sleep(max(0.0, due - time.time()))
        n = int(run.status().get("incarnation") or 0)
        if not delete_watched(run, victims(run, n, k), deletions, watches):
            victims.picks.pop()  # due but not serving (still being replaced): not deleted
        k += 1
    time.sleep(max(0.0, start + 2 * every - time.time()))
    wait(lambda: _pool_ready(run, standby, True, []), "the refills", SETTLE_S)
    return k
