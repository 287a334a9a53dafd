"""The pure parts of ``bench.operator_scale``'s report: each loss split into whose part it
is, and the two columns run in both orders and combined.

Why: the end-to-end time of a lost pod's replacement mixes the operator's two reactions with
the hollow kubelet's end of the old Gym pods (on a cluster, each node's kubelet's) and the
benchmark's own delete; only the operator's parts are this project's code. And the column
run second measured slower than the same code run first, so a comparison is only fair with
each column run in both positions (ABBA) and read per order as well as combined.
"""

from __future__ import annotations

import math
from typing import Any

from bench.operator_recovery import quantiles

#: Each part of a loss, as the difference of two marks of :func:`bench.operator_scale.phases`
#: (seconds from the trainer's deletion sent). They add up to ``end_to_end``.
PARTS = {
    "bench_delete": (None, "trainer_gone"),  # the benchmark's own delete call, committed
    "operator_lost_to_gyms_deleting": ("trainer_gone", "gyms_deleting"),
    "kubelet_gyms_deleting_to_gone": ("gyms_deleting", "gyms_gone"),
    "operator_gyms_gone_to_replacement": ("gyms_gone", "replacement"),
}
OPERATOR_PARTS = ("operator_lost_to_gyms_deleting", "operator_gyms_gone_to_replacement")
#: What a sample carries besides its phases.
NOT_PHASES = ("run", "lost_at", "second_of_minute", "parts")


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of ``ordered`` (sorted, non-empty) by nearest rank, the standard
    definition: the smallest value with at least ``q`` of the samples at or below it (at
    n = 100, p99 is the 99th value; the bench's ``p99``, index ``int(0.99 n)``, is the
    100th, the max)."""
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)], 3)


def spread(samples: list[float]) -> dict[str, Any]:
    """n, p50, p90, p99 and max, with p99 also by nearest rank (``p99_nearest_rank``;
    the bench's ``p99`` is the max for fewer than 100 samples, and still at 100: take
    more losses than 100 for a p99 that is not the largest one)."""
    found = quantiles(samples)
    if samples:
        ordered = sorted(samples)
        found["p90"] = round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3)
        found["p99_nearest_rank"] = nearest_rank(ordered, 0.99)
    return found


def loss_parts(marks: dict[str, float]) -> dict[str, float]:
    """A replaced loss's parts (:data:`PARTS`), the operator's own (``operator``: its two
    reactions), and ``end_to_end``; ``{}`` for a loss with a mark missing (not replaced)."""
    if any(mark not in marks for mark in ("trainer_gone", "gyms_deleting", "gyms_gone")):
        return {}
    if "replacement" not in marks:
        return {}
    found = {
        part: round(marks[end] - (marks[start] if start else 0.0), 3)
        for part, (start, end) in PARTS.items()
    }
    found["operator"] = round(sum(found[part] for part in OPERATOR_PARTS), 3)
    found["end_to_end"] = marks["replacement"]
    return found


def loss_summary(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The replacement spread (end to end, at the top level), each phase's and each part's
    spread, over the samples that were replaced."""
    phases: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}
    for sample in samples:
        if "replacement" not in sample:
            continue  # a missing one has no replacement phase
        for phase, at in sample.items():
            if phase not in NOT_PHASES:
                phases.setdefault(phase, []).append(at)
        for part, seconds in (sample.get("parts") or {}).items():
            parts.setdefault(part, []).append(seconds)
    return {
        **spread(phases.get("replacement", [])),
        "phases_s": {phase: spread(at) for phase, at in phases.items()},
        "parts_s": {part: spread(seconds) for part, seconds in parts.items()},
    }


def sequence(order: str) -> list[tuple[str, str]]:
    """The halves to run, in turn, as ``(column, order it belongs to)``: ``A`` is the
    baseline, ``B`` this tree; ``ABBA`` runs each column once first and once second."""
    if not order or set(order) - {"A", "B"} or len(order) % 2:
        raise ValueError(f"--order {order!r}: pairs of A (baseline) and B (this tree)")
    column = {"A": "baseline", "B": "load"}
    found = []
    for start in range(0, len(order), 2):
        pair = order[start : start + 2]
        if set(pair) != {"A", "B"}:
            raise ValueError(f"--order {order!r}: each pair runs A and B once ({pair!r})")
        first = column[pair[0]]
        found += [(column[letter], f"{first}_first") for letter in pair]
    return found


#: Figures of a half combined over its orders by their worst (the goals are upper bounds).
WORST = (
    "api_requests_per_run_per_minute",
    "api_requests_per_run_per_minute_with_resync",
    "operator_cpu_share_steady",
    "api_server_cpu_share_steady",
    "restarts_before_losses",
    "converged_s",
)


def combine(halves: list[dict[str, Any]]) -> dict[str, Any]:
    """One column over its halves (each tagged ``order``): per order as measured
    (``by_order``), and combined: the losses pooled, the steady figures at their worst,
    RSS at its largest; ``orders`` names where each came from."""
    if not halves:
        return {}
    combined: dict[str, Any] = {"orders": [half["order"] for half in halves]}
    for key in WORST:
        values = [half[key] for half in halves if half.get(key) is not None]
        if values:
            combined[key] = max(values)
    combined["operator_rss_mib"] = {
        kind: max(half["operator_rss_mib"][kind] for half in halves) for kind in ("steady", "peak")
    }
    losses = [half["pod_lost_to_replacement_s"] for half in halves]
    combined["pod_lost_to_replacement_s"] = {
        **loss_summary([sample for loss in losses for sample in loss["samples"]]),
        "skipped": sum(loss["skipped"] for loss in losses),
        "missing_after_120s": [m for loss in losses for m in loss["missing_after_120s"]],
        "goal_p99_s": 2.0,
    }
    by_order: dict[str, Any] = {}
    for half in halves:
        key, again = half["order"], 1
        while key in by_order:  # the same order run again (ABAB)
            again += 1
            key = f"{half['order']}_{again}"
        by_order[key] = {k: v for k, v in half.items() if k != "order"}
    return {"combined": combined, "by_order": by_order}


def goals(load: dict[str, Any]) -> dict[str, Any]:
    """Issue 16's goals read off this tree's combined column: the API load, and the
    replacement's p99 both as the bench computes it and by nearest rank."""
    losses = load["pod_lost_to_replacement_s"]
    return {
        "from": "load combined (every order; by_order has each)",
        "api_requests_per_run_per_minute_le_2": load["api_requests_per_run_per_minute"] <= 2,
        "pod_lost_to_replacement_p99_le_2s": losses.get("p99", 99) <= 2,
        "pod_lost_to_replacement_p99_nearest_rank_le_2s": losses.get("p99_nearest_rank", 99) <= 2,
    }
