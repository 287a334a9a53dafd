"""``rolloutrun audit RUN_DIR | STORAGE_URI | --run NAME``: load a run's durable state,
check it, print the verdict.

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
from rolloutrun_runtime.run_lookup import RunLookupError, add_target_arguments, resolve_target


def run_audit(
    run_dir: Path | None, *, config_file: Path | None = None, storage_uri: str | None = None
) -> AuditReport:
    """Audit a run: ``run_dir`` (its log directory; None: the storage alone) and/or
    ``storage_uri``. The seed and step count come from ``config_file``, else from the
    RunConfig the trainer kept in the storage (``run_logs/config/``), else the manifests."""
    seed = max_steps = None
    if config_file is not None:
        from rolloutrun_runtime.contract.run_config import load_run_config

        cfg = load_run_config(config_file)
        if run_dir is not None:
            cfg = cfg.model_copy(update={"log_dir": str(run_dir)})
            storage_uri = storage_uri or cfg.resolved_storage_uri()
        else:
            storage_uri = storage_uri or cfg.checkpointing.storage_uri
        seed, max_steps = cfg.seed, cfg.grpo.max_steps
    elif storage_uri is not None:
        seed, max_steps = _kept_config(storage_uri)
    state = load_durable_state(run_dir, storage_uri=storage_uri, seed=seed, max_steps=max_steps)
    return audit(state)


def _kept_config(storage_uri: str) -> tuple[int | None, int | None]:
    """Seed and ``grpo.maxSteps`` of the RunConfig the newest trainer kept in the storage."""
    from rolloutrun_runtime.run_logs import read_latest_config
    from rolloutrun_runtime.storage import StorageError, open_storage

    try:
        document = read_latest_config(open_storage(storage_uri))
    except (StorageError, ValueError) as error:
        raise AuditError(f"cannot read the run's config in {storage_uri}: {error}") from error
    if document is None:
        return None, None
    seed, max_steps = document.get("seed"), (document.get("grpo") or {}).get("maxSteps")
    return (
        seed if isinstance(seed, int) else None,
        max_steps if isinstance(max_steps, int) else None,
    )


# --------------------------------------------------------------------------- CLI
def register(parser: argparse.ArgumentParser) -> None:
    """Check from durable state that a run lost no prompt and repeated no side effect."""
    add_target_arguments(parser, "what to audit")
    parser.add_argument(
        "--config", default=None, help="the run's YAML (gives the seed and the storage URI)"
    )
    parser.add_argument(
        "--storage", default=None, help="storage URI (default: the target's; RUN_DIR/checkpoints)"
    )
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
        target = resolve_target(args)
        storage_uri = args.storage or (
            None if target.log_dir is not None and args.config else target.storage_uri
        )
        report = run_audit(
            target.log_dir,
            config_file=Path(args.config) if args.config else None,
            storage_uri=storage_uri,
        )
    except (AuditError, RunLookupError) as error:
        print(f"rolloutrun audit: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        print(_render_text(report))
    return 0 if report.ok else 1
