"""crash_point: armed by the environment, SIGKILLs at the n-th hit, errors name the sites."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from rolloutrun_runtime import crash

SCRIPT = """
import sys
from rolloutrun_runtime.crash import crash_point
for i in range(5):
    crash_point("after_manifest_write")
    print(i, flush=True)
"""


def _run(env_value: str | None) -> subprocess.CompletedProcess[str]:
    import os

    env = dict(os.environ)
    env.pop(crash.ENV_VAR, None)
    if env_value is not None:
        env[crash.ENV_VAR] = env_value
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=False
    )


@pytest.mark.parametrize(
    ("value", "printed", "killed"),
    [
        (None, 5, False),
        ("after_manifest_write", 0, True),
        ("after_manifest_write:3", 2, True),
        ("before_manifest_write", 5, False),
    ],
)
def test_kills_itself_at_the_nth_hit(value: str | None, printed: int, killed: bool) -> None:
    proc = _run(value)
    assert proc.stdout.split() == [str(i) for i in range(printed)]
    assert proc.returncode == (-signal.SIGKILL if killed else 0)


def test_unknown_site_is_an_error_naming_the_known_ones() -> None:
    proc = _run("after_manifest_wirte")
    assert proc.returncode == 1
    assert "unknown crash site 'after_manifest_wirte'" in proc.stderr
    assert "during_restore" in proc.stderr


@pytest.mark.parametrize("value", ["during_restore:0", "during_restore:x", "nope:2"])
def test_parse_rejects(value: str) -> None:
    with pytest.raises(crash.CrashConfigError):
        crash.parse_crash_at(value)


def test_parse_defaults_to_first_hit() -> None:
    assert crash.parse_crash_at("during_gym_commit") == ("during_gym_commit", 1)
    assert crash.parse_crash_at("during_gym_commit:4") == ("during_gym_commit", 4)


def test_unarmed_in_process_is_a_no_op() -> None:
    assert crash.arm_from_environ({}) is None
    for site in crash.CRASH_SITES:
        crash.crash_point(site)
