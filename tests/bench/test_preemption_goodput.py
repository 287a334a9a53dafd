"""bench/preemption_goodput.py: the summary over seeds (mean, spread, the worst seed)."""

from __future__ import annotations

from bench.preemption_goodput import aggregate


def test_the_goodput_summary_names_the_worst_seed_and_the_spread() -> None:
    runs = {1: {"steps_per_min": 9.0}, 2: {"steps_per_min": 6.0}, 3: {"steps_per_min": 8.0}}
    summary = aggregate(runs, {1: 10.0, 2: 10.0, 3: 8.0})
    assert summary["worst_seed"] == 2 and summary["ratio_worst"] == 0.6
    assert summary["ratio_stdev"] > 0 and summary["steps_per_min_stdev"] > 0
    assert summary["per_seed"]["3"]["ratio"] == 1.0
