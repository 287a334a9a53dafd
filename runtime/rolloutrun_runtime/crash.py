"""Named crash sites: the places where a SIGKILL proves the recovery protocol.

Why named sites rather than only random kills: the interesting crashes sit in windows a
few microseconds wide (between the dataloader advance and the reservation, between the
data-plane save and the sidecars, inside the optimizer-commit window). A random kill almost
never lands there; a named site lands there every time. The controller calls
``crash_point("<site>")`` at each window; the crash tests arm one site through the
environment variable ``ROLLOUTRUN_CRASH_AT=<site>[:<n>]`` and the process kills itself with
SIGKILL (no ``finally``, no atexit, no flush) at the n-th hit of that site.

Unarmed, a call costs one dict lookup. The variable is read once, at import; a name that
is not in ``CRASH_SITES`` is an error naming the known sites, raised by the first
``crash_point`` call so that a mistyped test never passes by not crashing.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

ENV_VAR = "ROLLOUTRUN_CRASH_AT"

CRASH_SITES: tuple[str, ...] = (
    "after_dataloader_advance",
    "inside_finalize_commit",
    "after_data_plane_save",
    # A snapshot's new data-plane segments are durable, its manifest not yet written.
    "after_segment_write",
    "before_manifest_write",
    "after_manifest_write",
    # A snapshot at weight version 0 (bootstrap anchor, no step committed) just published:
    # the next incarnation resumes at the version its workers already hold.
    "before_first_checkpoint",
    "inside_optimizer_commit",
    "during_trainer_checkpoint_finalize",
    "during_gym_prepare",
    "during_gym_commit",
    "during_gym_resume",
    "during_restore",
    # Collecting data-plane segments no committed manifest lists (after the first one it
    # deletes, or spares while younger than the orphan grace).
    "during_segment_gc",
    # The snapshot writer's child process (storage/writer_process.py) killed after one file of
    # a write is renamed, before the rest and the folders' fsyncs: the trainer lives on.
    "helper_mid_write",
    # The writer child killed after the trainer linked a snapshot's manifest (committed),
    # before it made the link durable: the trainer's publication fails, the snapshot stands.
    "helper_before_settle",
    # The trainer killed while its writer process writes a snapshot's files (the child
    # dies with it).
    "trainer_while_helper_writes",
)


class CrashConfigError(ValueError):
    """``ROLLOUTRUN_CRASH_AT`` names no known crash site or has a bad hit count."""


def parse_crash_at(value: str) -> tuple[str, int]:
    """``"<site>[:<n>]"`` -> ``(site, n)``; n defaults to 1 and must be >= 1."""
    name, sep, count = value.strip().partition(":")
    if name not in CRASH_SITES:
        raise CrashConfigError(
            f"{ENV_VAR}={value!r}: unknown crash site {name!r}; "
            f"known sites: {', '.join(CRASH_SITES)}"
        )
    if not sep:
        return name, 1
    try:
        n = int(count)
    except ValueError:
        raise CrashConfigError(
            f"{ENV_VAR}={value!r}: hit count {count!r} is not an integer"
        ) from None
    if n < 1:
        raise CrashConfigError(f"{ENV_VAR}={value!r}: hit count must be >= 1, got {n}")
    return name, n


# site -> remaining hits before the kill; empty when nothing is armed (the fast path).
_remaining: dict[str, int] = {}
_config_error: CrashConfigError | None = None


def arm_from_environ(environ: dict[str, str] | None = None) -> str | None:
    """(Re)read the variable; returns the armed site or None. Called once at import."""
    global _config_error
    env = os.environ if environ is None else environ
    _remaining.clear()
    _config_error = None
    value = env.get(ENV_VAR, "")
    if not value:
        return None
    try:
        name, n = parse_crash_at(value)
    except CrashConfigError as err:
        _config_error = err
        # Any site name routes to the error, so the first call raises it.
        _remaining.update(dict.fromkeys(CRASH_SITES, 0))
        return None
    _remaining[name] = n
    return name


def crash_point(name: str) -> None:
    """SIGKILL this process at the armed hit of site ``name``; otherwise return at once."""
    left = _remaining.get(name)
    if left is None:
        return
    if _config_error is not None:
        raise _config_error
    left -= 1
    _remaining[name] = left
    if left > 0:
        return
    logger.warning("crash site %s armed by %s: SIGKILL pid %d", name, ENV_VAR, os.getpid())
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


arm_from_environ()
