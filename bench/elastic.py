"""Elastic members benchmark on the local cluster, printed as JSON.

Three arms of the same run (the real trainer and Gym pods), one after the other in this one
process, each trained for the same window of wall clock:

- ``undisturbed``: nothing deleted (the rate to compare with).
- ``elastic``: a Gym pod deleted every ``--every`` seconds; the operator replaces it while
  the trainer goes on (``recovery.elasticMembers: true``, the default).
- ``ending``: the same deletions with ``recovery.elasticMembers: false``: each lost Gym
  ends the incarnation (the behaviour before elastic members).

Per arm: train steps per minute over the window (highest step reached, so steps trained
again after a restart are not counted twice), incarnations, and per deletion the recovery
time: elastic, from the deletion until the trainer re-admitted the replacement (its log
line: the replacement takes rollouts again) and until the operator saw it Ready
(``status.memberReplacements``); ending, from the deletion until the next incarnation
trained its first step. Goals (issue 14): elastic >= 90 % of the undisturbed rate; loss
-> replacement doing work <= 5 s.

Usage: ``python -m bench.elastic [--window 90] [--every 15] [--quick]``. The machine may be
shared: the arms run in one process, back to back, so they share its load.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements

from .operator_recovery import LONG_RUN, wait

READMITTED = "re-admitted at"


def _document(elastic: bool) -> dict[str, Any]:
    document = copy.deepcopy(LONG_RUN)
    document["spec"]["recovery"]["elasticMembers"] = elastic
    return document


def _highest_step(run: EmbeddedRun) -> int:
    metrics = run.log_dir / "metrics.jsonl"
    steps = [0]
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError):
                continue
    return max(steps)


def _log_times(run: EmbeddedRun, marker: str) -> list[float]:
    """Epoch times of the trainer log lines (every incarnation) holding ``marker``."""
    times = []
    for log in sorted((run.work_dir / "cluster").glob("pods/*/*-trainer-*/logs/trainer.log")):
        for line in log.read_text(errors="replace").splitlines():
            if marker in line:
                stamp = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                times.append(stamp.timestamp())
    return sorted(times)


def _first_step_after(run: EmbeddedRun, since: float, incarnation: int) -> float | None:
    """Epoch time the trainer of ``incarnation`` (or later) first trained, after ``since``."""
    while True:
        if int(run.status().get("incarnation") or 0) >= incarnation:
            lease = run.lease()
            holder = (lease.spec.holder_identity or "") if lease is not None else ""
            notes = (lease.metadata.annotations or {}) if lease is not None else {}
            n = holder.rsplit("/", 1)[-1]
            if n.isdigit() and int(n) >= incarnation and notes.get("rolloutrun.dev/train-step"):
                return time.time()
        if time.time() - since > 180:
            return None
        time.sleep(0.05)


def arm(
    name: str, work: Path, *, elastic: bool, delete: bool, window: float, every: float
) -> dict[str, Any]:
    """One arm: start, wait for training, run ``window`` seconds deleting Gym pods."""
    with EmbeddedRun(_document(elastic), work / name) as run:
        wait(lambda: _highest_step(run) >= 2, f"{name}: training", bound=600)
        start, first = time.time(), _highest_step(run)
        deletions: list[tuple[float, str]] = []
        recoveries: list[float] = []
        next_delete = start + every
        k = 0
        while time.time() < start + window:
            if delete and time.time() >= next_delete:
                n = int(run.status().get("incarnation") or 0)
                victim = f"bench-i{n}-gym-{k % 2}"
                if victim in run.serving_members():
                    at = time.time()
                    run.delete_pod(victim)
                    deletions.append((at, victim))
                    k += 1
                    if not elastic:  # time the restart inline (the next deletion waits)
                        resumed = _first_step_after(run, at, n + 1)
                        if resumed is not None:
                            recoveries.append(resumed - at)
                next_delete = max(next_delete + every, time.time() + 1)
            time.sleep(0.05)
        steps = _highest_step(run) - first
        elapsed = time.time() - start
        status = run.status()
        result: dict[str, Any] = {
            "window_s": round(elapsed, 1),
            "steps": steps,
            "steps_per_min": round(steps / elapsed * 60, 2),
            "deletions": len(deletions),
            "incarnations": int(status.get("incarnation") or 0),
        }
        if delete and elastic:
            readmitted = _log_times(run, READMITTED)
            doing_work = [
                next(t for t in readmitted if t >= at) - at
                for at, _ in deletions
                if any(t >= at for t in readmitted)
            ]
            result["loss_to_readmitted_s"] = _stats(doing_work)
            replaced = member_replacements(status).get("gym", {})
            result["loss_to_ready_s (operator)"] = _stats(replaced.get("recent_s") or [])
            result["replacements"] = replaced.get("count", 0)
        if delete and not elastic:
            result["loss_to_training_again_s"] = _stats(recoveries)
        return result


def _stats(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50": round(statistics.median(samples), 2),
        "max": round(max(samples), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=float, default=90.0, help="seconds trained per arm")
    parser.add_argument("--every", type=float, default=15.0, help="seconds between deletions")
    parser.add_argument("--quick", action="store_true", help="a 45 s window")
    args = parser.parse_args()
    window = 45.0 if args.quick else args.window
    Path(".rolloutrun").mkdir(exist_ok=True)  # pods see the work dir (not a private /tmp)
    with tempfile.TemporaryDirectory(prefix="bench-elastic-", dir=".rolloutrun") as tmp:
        work = Path(tmp).resolve()
        arms = {
            "undisturbed": arm("undisturbed", work, elastic=True, delete=False, window=window,
                               every=args.every),
            "elastic": arm("elastic", work, elastic=True, delete=True, window=window,
                           every=args.every),
            "ending": arm("ending", work, elastic=False, delete=True, window=window,
                          every=args.every),
        }  # fmt: skip
    base = arms["undisturbed"]["steps_per_min"] or 1.0
    print(
        json.dumps(
            {
                "every_s": args.every,
                "arms": arms,
                "elastic_vs_undisturbed": round(arms["elastic"]["steps_per_min"] / base, 3),
                "ending_vs_undisturbed": round(arms["ending"]["steps_per_min"] / base, 3),
                "note": "arms run back to back in one process on a possibly shared machine",
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
