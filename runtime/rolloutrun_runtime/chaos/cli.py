"""``rolloutrun chaos FILE --kills N``: the command around :func:`run_chaos`.

Why apart: the exit codes (0 the campaign held, 1 it did not, 2 it could not run) and the
printed summary are the interface to users and CI; the campaign stays free of argparse.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rolloutrun_runtime.chaos.campaign import run_chaos
from rolloutrun_runtime.chaos.processes import ChaosError


def register(parser: argparse.ArgumentParser) -> None:
    """SIGKILL a run's trainer N times, resume it each time, then audit it."""
    parser.add_argument("file", help="RolloutRun YAML (its spec.run) or a bare RunConfig")
    parser.add_argument("--kills", type=int, required=True, help="how many SIGKILLs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument(
        "--site",
        default=None,
        help="kill at this named crash site, NAME or NAME:HIT (default: a random hit 1..3)",
    )
    parser.add_argument("--log-dir", default=None, help="new directory for the run (default: tmp)")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compare final weights with an uninterrupted run (default: deterministic configs)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(handler=main)


def main(args: argparse.Namespace) -> int:
    import tempfile

    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="rr-chaos-"))
    try:
        result = run_chaos(
            Path(args.file),
            log_dir,
            kills=args.kills,
            seed=args.seed,
            site=args.site,
            compare=args.compare,
        )
    except ChaosError as error:
        print(f"rolloutrun chaos: {error}", file=sys.stderr)
        return 2
    data = result.to_json()
    data["log_dir"] = str(log_dir)
    if args.json:
        print(json.dumps(data, indent=1, sort_keys=True))
    else:
        audit = result.audit
        print(
            f"chaos {'OK' if result.ok else 'FAILED'}: {len(result.kills)} kills, "
            f"{result.resumes} resumes; audit lost {audit.get('lost')} duplicated "
            f"{audit.get('duplicated')} ok {audit.get('ok')}; weights_match "
            f"{result.weights_match}; {lost_words(data)}; logs in {log_dir}"
        )
    return 0 if result.ok else 1


def lost_words(data: dict[str, Any]) -> str:
    """What the kills cost, per kill: every rollout second the resumed incarnations could not
    keep, and of it what was thrown away at the restored cuts. The thrown-away figure alone
    read ``0.0`` for kills resumed from a trainer checkpoint or from nothing, which lose all
    the work after their cut (it counts attempts dispatched before the cut only)."""
    lost = [round(value, 1) for value in data["rollout_work_lost_s"]]
    thrown = [round(value, 1) for value in data["thrown_away_s"]]
    return f"rollout work lost per kill {lost} s (thrown away at the restored cut {thrown} s)"
