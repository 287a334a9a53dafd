"""bench/throughput_blocks.py: the on/off schedule, the blocks and pairs cut from one run's
per-step samples, the interval and the verdict against it, and the gate on the runtime's
snapshot decision (pure, or one decision call; the runs themselves are never timed here)."""

from __future__ import annotations

import math

import pytest

from bench import throughput_blocks as tb
from rolloutrun_runtime.algorithms.rollout_checkpointing import snapshots


def test_the_schedule_is_warm_up_then_abba_blocks() -> None:
    sides = [tb.side_of(step, 2, 3)[0] for step in range(1, 2 + 12 + 1)]
    assert sides == ["on"] * 2 + ["on"] * 3 + ["off"] * 6 + ["on"] * 3
    assert tb.side_of(2, 2, 3) == ("on", -1) and tb.side_of(3, 2, 3) == ("on", 0)
    assert tb.total_steps(6, 4, 8) == 6 + 128


def test_equal_trees_alternate_abba_by_pair_of_runs() -> None:
    got = tb.schedule({"baseline": 3, "this_tree": 3})
    assert got == [
        ("baseline", 0), ("this_tree", 0),
        ("this_tree", 1), ("baseline", 1),
        ("baseline", 2), ("this_tree", 2),
    ]  # fmt: skip


def test_a_tree_with_fewer_pairs_is_spread_over_the_whole_measurement() -> None:
    got = tb.schedule({"baseline": 2, "this_tree": 8})
    assert sorted(got) == [("baseline", i) for i in range(2)] + [("this_tree", i) for i in range(8)]
    where = [i for i, (tree, _) in enumerate(got) if tree == "baseline"]
    assert where[0] in (1, 2, 3) and where[1] in (6, 7, 8)  # one in each half, not both first
    assert [i for tree, i in got if tree == "this_tree"] == list(range(8))
    assert tb.schedule({"this_tree": 2}) == [("this_tree", 0), ("this_tree", 1)]


def _samples(step_s: dict[str, float], cpu_ms: dict[str, float], warmup: int, block: int, n):
    """Cumulative per-step samples: each step takes its side's time and CPU (the guard step
    of every block twice as long, which the blocks must leave out)."""
    t = cpu = 0.0
    out = []
    for step in range(1, n + 1):
        side, index = tb.side_of(step, warmup, block)
        guard = index >= 0 and (step - warmup - 1) % block == 0
        t += step_s[side] * (2 if guard else 1)
        cpu += cpu_ms[side] / 1000 * (2 if guard else 1)
        out.append({"t": t, "cpu": cpu, "gym_cpu": cpu / 4, "tokens": 10})
    return out


def test_blocks_leave_the_guard_step_out_and_pairs_compare_on_with_off() -> None:
    samples = _samples({"on": 0.52, "off": 0.5}, {"on": 240, "off": 200}, 3, 4, 3 + 16 + 2)
    rows = tb.blocks(samples, 3, 4)
    assert [r["side"] for r in rows] == ["on", "off", "off", "on"]  # the last, partial, left
    assert rows[0]["step_s"] == pytest.approx(0.52) and rows[1]["step_s"] == pytest.approx(0.5)
    assert rows[0]["cpu_ms"] == pytest.approx(300.0)  # trainer 240 + Gym 60
    got = tb.pairs(rows)
    assert len(got) == 2
    assert got[0]["ratio"] == pytest.approx(0.5 / 0.52) == got[1]["ratio"]
    assert got[0]["cpu_ratio"] == pytest.approx(250 / 300)
    assert got[1]["snapshot_cpu_ms"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="not an on/off pair"):
        tb.pairs([rows[1], rows[2]])


def test_the_interval_is_over_the_pairs_log_ratios() -> None:
    ci = tb.interval([0.99, 1.0, 1.01, 1.0])
    logs = [math.log(r) for r in (0.99, 1.0, 1.01, 1.0)]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    assert ci["mean"] == pytest.approx(math.exp(mean), abs=1e-4)
    assert ci["low"] == pytest.approx(math.exp(mean - 3.182 * sd / 2), abs=1e-4)
    assert ci["high"] == pytest.approx(math.exp(mean + 3.182 * sd / 2), abs=1e-4)
    assert tb.t975(35) == 2.042 and tb.t975(500) == 1.96
    with pytest.raises(ValueError, match="two pairs"):
        tb.interval([1.0])


def test_the_pairs_to_certify_are_where_the_low_end_would_reach_the_goal() -> None:
    ratios = [0.9975 * math.exp(d) for d in (-0.016, 0.016) * 200]  # mean 0.9975, sd ~0.016
    needed = tb.pairs_to_certify(ratios)
    assert needed is not None and 100 < needed < 200
    # that many pairs alike put the interval's low end at the goal, half as many below it
    assert tb.interval(ratios[: needed + needed % 2])["low"] >= 0.995 - 1e-4
    assert tb.interval(ratios[: needed // 2])["low"] < 0.995
    # a larger margin or a smaller spread needs fewer pairs
    assert tb.pairs_to_certify([r * 1.002 for r in ratios]) < needed
    assert tb.pairs_to_certify([0.9975 * math.exp(d / 2) for d in (-0.016, 0.016) * 200]) < needed
    # a mean at or below the goal is never certified, however long the reading
    assert tb.pairs_to_certify([0.99, 0.995, 1.0]) is None
    assert tb.pairs_to_certify([0.9975]) is None


def test_the_goal_is_met_only_when_the_whole_interval_clears_it() -> None:
    assert tb.verdict({"low": 0.996, "mean": 1.0, "high": 1.004}) is True
    assert tb.verdict({"low": 0.99, "mean": 1.0, "high": 1.01}) is None
    assert tb.verdict({"low": 0.95, "mean": 0.97, "high": 0.99}) is False
    samples = _samples({"on": 0.6, "off": 0.5}, {"on": 260, "off": 200}, 2, 3, 2 + 12 * 4)
    got = tb.pairs(tb.blocks(samples, 2, 3))
    got[0] = {**got[0], "ratio": 0.84}
    summary = tb.summarize(got)
    assert summary["met"] is False and summary["ratio"]["high"] < 0.995


def test_the_gate_snapshots_after_a_step_only_when_the_next_one_is_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        snapshots, "should_snapshot_after_step", snapshots.should_snapshot_after_step
    )
    cls = snapshots.RolloutSnapshotter
    monkeypatch.setattr(cls, "trainer_checkpoint_published", cls.trainer_checkpoint_published)
    tb.install_gate(warmup=2, block=3)
    decide = snapshots.should_snapshot_after_step
    # steps 1-2 warm-up, 3-5 on, 6-11 off, 12-17 on
    assert [s for s in range(1, 15) if decide(s, 1)] == [1, 2, 3, 4, 11, 12, 13, 14]
    assert not decide(12, 0)  # the config's own decision still applies


def test_the_complementary_run_swaps_every_block_and_cancels_a_steps_own_cost() -> None:
    warmup, block, n = 2, 3, 2 + 12 * 2
    assert [tb.side_of(s, warmup, block, 1)[0] for s in range(1, 15)] == (
        ["on"] * 2 + ["off"] * 3 + ["on"] * 6 + ["off"] * 3
    )

    def run(phase: int) -> list[dict[str, float]]:
        """Snapshots cost nothing, but steps 4-5 (block 0's) are twice as long: one
        schedule alone puts them on one side."""
        t = cpu = 0.0
        out = []
        for step in range(1, n + 1):
            t += 1.0 if step in (4, 5) else 0.5
            cpu += 0.2
            out.append({"t": t, "cpu": cpu, "gym_cpu": 0.0, "tokens": 1})
        return tb.pairs(tb.blocks(out, warmup, block, phase))

    first, second = run(0), run(1)
    assert first[0]["ratio"] == pytest.approx(0.5) and second[0]["ratio"] == pytest.approx(2.0)
    both = tb.complementary(first, second)
    assert [s["ratio"] for s in both] == pytest.approx([1.0] * len(both))
    assert tb.summarize(both)["ratio"]["mean"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="differ in block pairs"):
        tb.complementary(first, second[:-1])


def test_the_snapshot_cpu_is_split_by_where_it_ran() -> None:
    """Each sample's per-thread and writer-child CPU give each pair's on-minus-off share per
    place, and the summary their mean (the writer child, which the CPU ratio leaves out)."""
    samples = _samples({"on": 0.52, "off": 0.5}, {"on": 240, "off": 200}, 3, 4, 3 + 16)
    loop = child = 0.0
    for step, sample in enumerate(samples, start=1):
        on = tb.side_of(step, 3, 4)[0] == "on"
        loop += 0.030 if on else 0.024
        child += 0.012 if on else 0.0
        sample["threads"] = {"MainThread": loop, "asyncio": 0.001 * step}
        sample["child_cpu"] = child
    got = tb.pairs(tb.blocks(samples, 3, 4))
    assert got[0]["cpu_ms:MainThread"] == pytest.approx(6.0)
    assert got[0]["cpu_ms:asyncio"] == pytest.approx(0.0)
    assert got[0]["cpu_ms:writer child"] == pytest.approx(12.0)
    assert got[0]["cpu_ms:gym"] == pytest.approx(10.0)  # a quarter of the 40 ms trainer's
    by_place = tb.summarize(got)["snapshot_cpu_ms_by_place"]
    assert by_place == {"MainThread": 6.0, "asyncio": 0.0, "gym": 10.0, "writer child": 12.0}


def _pairs_of_runs(run_means: list[float], noise: float = 0.016, n: int = 16):
    """Pairs of runs whose block pairs' log ratios are each run's mean, then +-``noise``."""
    return [
        [{"ratio": math.exp(mean + (noise if k % 2 else -noise))} for k in range(n)]
        for mean in run_means
    ]


def test_runs_that_agree_as_their_blocks_predict_make_pooling_sound() -> None:
    got = tb.between_pairs_of_runs(_pairs_of_runs([0.0, 0.004, -0.004, 0.002]))
    assert got is not None and got["pairs_of_runs"] == 4
    assert got["sd_expected_from_blocks"] == pytest.approx(0.016 * math.sqrt(16 / 15 / 16), 1e-3)
    assert got["spread_ratio"] < 1 and got["runs_differ"] is False


def test_runs_that_differ_beyond_their_blocks_are_flagged_with_the_interval_over_runs() -> None:
    samples = _pairs_of_runs([0.0, 0.02, -0.02, 0.01])
    got = tb.between_pairs_of_runs(samples)
    assert got is not None and got["spread_ratio"] > 3 and got["runs_differ"] is True
    pooled = tb.interval([p["ratio"] for pair in samples for p in pair])
    over = got["over_pairs"]
    assert over["n"] == 4 and over["mean"] == pytest.approx(pooled["mean"], abs=1e-4)
    assert over["high"] - over["low"] > 3 * (pooled["high"] - pooled["low"])


def test_one_pair_of_runs_says_nothing_about_the_spread_between_runs() -> None:
    assert tb.between_pairs_of_runs(_pairs_of_runs([0.0])) is None


def test_blocks_without_spread_flag_runs_that_differ_at_all() -> None:
    got = tb.between_pairs_of_runs(_pairs_of_runs([0.0, 0.01], noise=0.0))
    assert got is not None and got["spread_ratio"] is None and got["runs_differ"] is True
