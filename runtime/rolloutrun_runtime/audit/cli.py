"""``rolloutrun audit RUN_DIR``: load a run's durable state, check it, print the verdict.

Why a module of its own: the command's exit codes (0 every check holds, 1 one fails, 2 the
state cannot be read) and its text and JSON renderings are the audit's interface to users
and to the chaos harness; loading and checking stay free of argparse and printing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rolloutrun_runtime.audit.checks import AuditReport, audit
from rolloutrun_runtime.audit.durable import load_durable_state
from rolloutrun_runtime.audit.state import EXAMPLES, AuditError


def run_audit(
    run_dir: Path, *, config_file: Path | None = None, storage_uri: str | None = None
) -> AuditReport:
    """Load and audit ``run_dir``; ``config_file`` supplies the seed and the storage URI."""
    seed = max_steps = None
    if config_file is not None:
        from rolloutrun_runtime.contract.run_config import load_run_config

        cfg = load_run_config(config_file)
        cfg = cfg.model_copy(update={"log_dir": str(run_dir)})
        seed, max_steps = cfg.seed, cfg.grpo.max_steps
        storage_uri = storage_uri or cfg.resolved_storage_uri()
    state = load_durable_state(run_dir, storage_uri=storage_uri, seed=seed, max_steps=max_steps)
    return audit(state)


# --------------------------------------------------------------------------- CLI
def register(parser: argparse.ArgumentParser) -> None:
    """Check from durable state that a run lost no prompt and repeated no side effect."""
    parser.add_argument("run_dir", help="the run's log directory")
    parser.add_argument(
        "--config", default=None, help="the run's YAML (gives the seed and the storage URI)"
    )
    parser.add_argument("--storage", default=None, help="storage URI (default RUN_DIR/checkpoints)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=main)


def _render_text(report: AuditReport) -> str:
    verdict = "OK" if report.ok else "FAILED"
    p = report.prompts
    lines = [
        f"audit {verdict}: {report.source} (step {report.step})",
        f"  prompts: drawn {p.drawn}, trained {p.trained}, pending {p.pending}, dropped "
        f"{p.dropped}; lost {p.lost}, duplicated {p.duplicated}, undrawn {p.undrawn} "
        f"(drawn set from the {p.drawn_from})",
        f"  side effects: {report.side_effects.applied} applied, "
        f"{report.side_effects.duplicated} applied twice, "
        f"{report.side_effects.torn_lines} unreadable, "
        f"{report.side_effects.torn_tails} torn tails (tolerated)",
        f"  gym attempts: {report.gym_attempts.turn_restores} turn restores, "
        f"{report.gym_attempts.violations} violations",
        f"  rows: {report.rows.orphaned_staging} orphaned staging, "
        f"{report.rows.orphaned_train} orphaned train, replay/ledger mismatches "
        f"{report.rows.replay_not_finalized + report.rows.finalized_not_in_replay}",
    ]
    lines += [f"    unreadable: {place}" for place in report.side_effects.torn_examples]
    lines += [f"    torn tail: {place}" for place in report.side_effects.torn_tail_examples]
    lines += [f"    {example}" for example in report.gym_attempts.examples[:EXAMPLES]]
    lines += [f"    {example}" for example in report.rows.examples]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import sys

    try:
        report = run_audit(
            Path(args.run_dir),
            config_file=Path(args.config) if args.config else None,
            storage_uri=args.storage,
        )
    except AuditError as error:
        print(f"rolloutrun audit: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        print(_render_text(report))
    return 0 if report.ok else 1
