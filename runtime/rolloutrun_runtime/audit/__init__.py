"""``rolloutrun audit RUN_DIR``: prove from durable state alone that a run lost nothing.

Why from durable state only: a crash tears memory, logs and in-flight writes, so a claim
that "no prompt was lost and none trained twice" is only worth something if it is checked
against what a restart would read: the newest committed trainer checkpoint (or snapshot) of
the run's storage and the Gym replicas' side-effect records (audit files, or objects under
the storage's ``gym-audit/``). Nothing here reads metrics, the trace or a process's memory.

The loading is thin I/O (:func:`load_durable_state`); every check is a pure function over
the loaded :class:`DurableState` and returns its own small report, so each one is
table-tested against doctored states. The package, along those seams:

* :mod:`.state` — the loaded state's records (:class:`DurableState` and its parts);
* :mod:`.durable` — reading the newest trainer checkpoint or snapshot: trainer state,
  training journal, ledger sidecar, runtime state, data-plane metadata (names from
  :mod:`rolloutrun_runtime.contract.layout`, never from the writers' modules);
* :mod:`.side_effects` — reading the Gym's side-effect records (files and objects);
* :mod:`.checks` — the pure checks and the :class:`AuditReport`;
* :mod:`.cli` — ``rolloutrun audit``: load, check, render, exit code.

Import from this package face. The checks:

* **prompts** — for every epoch up to the final dataloader cursor, each drawn prompt
  (from the per-epoch permutation, a pure function of seed and epoch) is trained exactly
  once (the training journal), still pending (ledger, spare pool, deterministic spare
  reserves, replay view), or recorded as dropped by the journal. ``lost`` counts drawn
  prompts that are none of these; ``duplicated`` counts prompts trained more than once
  within an epoch; ``undrawn`` counts trained or pending prompts beyond the cursor (a cursor
  that went backwards).
* **side effects** — no ``(rollout_id, revision)`` appears twice across the Gym audit files
  and the ``gym-audit/`` objects of the run's storage (across replicas, in the run-wide
  ``<rollout>/<revision>.json`` layout and the older per-replica one). An unreadable line
  inside an audit file, or an unreadable object, fails the audit (named by file and line,
  or key): a record that cannot be read may hide a duplicate. An audit file's unterminated
  last line is a torn tail (a crash mid-append; its effect was never applied, and the
  writer cuts it when it reopens the file): reported, tolerated, not counted as applied.
* **gym attempts** — per rollout, the environment attempt recorded with its effects never
  goes back (one more per turn-level restore; an older attempt applying an effect after a
  newer one is a zombie), the ledger's ``gym_attempt`` is never behind what the environment
  applied, and only turn-level groups have ``gym_attempt > 0``.
* **rows** — every ``staging`` row of the data plane is referenced by a ledger attempt,
  every ``train`` row belongs to a replay group (or a step kept for replay), and the replay
  view holds exactly the ledger's finalized groups.

Exit 0 only when every check holds; 1 when one fails; 2 when the state cannot be read.
"""

from rolloutrun_runtime.audit.checks import (
    AUDIT_SCHEMA,
    AuditReport,
    GymAttemptReport,
    PromptReport,
    RowReport,
    SideEffectReport,
    audit,
    check_gym_attempts,
    check_prompts,
    check_rows,
    check_side_effects,
)
from rolloutrun_runtime.audit.cli import main, register, run_audit
from rolloutrun_runtime.audit.durable import (
    load_durable_state,
    parse_journal,
    parse_ledger,
    parse_reserves,
    permutations_for,
)
from rolloutrun_runtime.audit.side_effects import (
    load_side_effects,
    parse_audit_file,
    parse_side_effect_object,
    parse_side_effects,
)
from rolloutrun_runtime.audit.state import (
    EXAMPLES,
    AuditError,
    DurableState,
    LedgerAttempt,
    LedgerGroup,
    Prompt,
    SideEffect,
    TornRecords,
)

__all__ = [
    "AUDIT_SCHEMA",
    "EXAMPLES",
    "AuditError",
    "AuditReport",
    "DurableState",
    "GymAttemptReport",
    "LedgerAttempt",
    "LedgerGroup",
    "Prompt",
    "PromptReport",
    "RowReport",
    "SideEffect",
    "SideEffectReport",
    "TornRecords",
    "audit",
    "check_gym_attempts",
    "check_prompts",
    "check_rows",
    "check_side_effects",
    "load_durable_state",
    "load_side_effects",
    "main",
    "parse_audit_file",
    "parse_journal",
    "parse_ledger",
    "parse_reserves",
    "parse_side_effect_object",
    "parse_side_effects",
    "permutations_for",
    "register",
    "run_audit",
]
