"""Thrown-away rollout time per kill, this tree side by side with another checkout.

Why: ``bench.rollout_checkpoint --parts thrown_away`` compares snapshots against trainer
checkpoints only within one runtime; a change to the snapshot path must also be compared
with the runtime it replaces, on the same machine at the same time (the load on a shared
machine moves both sides of the ratio). Here each kill seed runs that part once per tree,
in a fresh process whose runtime (and the trainers it launches) is that tree's, the trees'
order alternating seed by seed; per tree, the per-seed rows, spread, worst seed and ratio
are ``bench.rollout_checkpoint.summarize``'s.

``python -m bench.thrown_away --baseline DIR [--seeds 1 2 3 4 5] [--kills 6] [--out FILE]``;
``--quick``: ``bench.rollout_checkpoint``'s quick run (an 8-step run), for the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SEEDS = [1, 2, 3, 4, 5]


def _one(tree: Path, seed: int, kills: int, out: Path, quick: bool) -> dict[str, Any]:
    """One seed, both sides, with ``tree``'s runtime: ``bench.rollout_checkpoint``'s
    ``thrown_away`` report."""
    here = Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(here), str(tree / "runtime"), str(tree / "operator")])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.rollout_checkpoint",
            "--parts",
            "thrown_away",
            "--seeds",
            str(seed),
            "--kills",
            str(kills),
            "--out",
            str(out),
            *(["--quick"] if quick else []),
        ],
        env={**os.environ, "PYTHONPATH": path},
        cwd=here,
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=7200,
    )
    return json.loads(out.read_text())["thrown_away"]


def compare(
    baseline: str, seeds: list[int], kills: int, root: Path, quick: bool = False
) -> dict[str, Any]:
    """Every seed for both trees, alternating; per tree ``summarize`` over the seeds."""
    from bench.rollout_checkpoint import summarize

    here = Path(__file__).resolve().parent.parent
    trees = {"baseline": Path(baseline).resolve(), "this_tree": here}
    per_seed: dict[str, dict[str, dict[int, dict[str, Any]]]] = {
        tree: {"snapshots": {}, "trainer_checkpoints_only": {}} for tree in trees
    }
    load = [round(os.getloadavg()[0], 2)]
    started = time.monotonic()
    for turn, seed in enumerate(seeds):
        order = list(trees) if turn % 2 == 0 else list(reversed(trees))
        for tree in order:
            got = _one(trees[tree], seed, kills, root / f"{tree}-s{seed}.json", quick)
            for side, rows in per_seed[tree].items():
                rows[seed] = got[side]["per_seed"][str(seed)]
            ratio = got["ratio_per_seed"][str(seed)]
            print(f"seed {seed} {tree}: ratio {ratio}", file=sys.stderr, flush=True)
        load.append(round(os.getloadavg()[0], 2))
    out: dict[str, Any] = {
        tree: {"tree": str(path), **summarize(per_seed[tree])} for tree, path in trees.items()
    }
    out.update(
        seeds=seeds,
        kills_per_seed=kills,
        load_1m_per_seed=load,
        cpus=os.cpu_count(),
        wall_s=round(time.monotonic() - started, 1),
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="another checkout (e.g. main)")
    parser.add_argument("--seeds", type=int, nargs="+", default=SEEDS)
    parser.add_argument("--kills", type=int, default=6)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="thrown-away-") as root:
        result = compare(args.baseline, args.seeds, args.kills, Path(root), args.quick)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
