"""A worker node's ``ray start`` with Ray's dashboard agent replaced by a placeholder
(:mod:`rolloutrun_runtime.workers.ray_boot`, :mod:`rolloutrun_runtime.workers.ray_agent_stub`).

The placeholder is a real process here: it persists the agent's ports where Ray's own
reader (``ray._raylet.wait_for_persisted_port``) finds them, and ends with the process that
started it (the raylet). The rewrite of the raylet's command is checked against this Ray,
and each assumption it rests on fails by name when it no longer holds. A whole worker node
started this way serves an actor and reports its loss in ``test_ray_node_loss.py`` (chaos).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.contract.pod import RAY_GENERATION_RESOURCE
from rolloutrun_runtime.workers import ray_agent_stub, ray_boot
from rolloutrun_runtime.workers.ray_node import BOOT_MODULE, worker_argv

NODE_ID = "ab" * 28
#: Only a hang guard: the placeholder looks at its parent every PARENT_POLL_S.
HANG_S = 30


def _ray_agent_command(session_dir: str) -> str:
    """A dashboard-agent command line as Ray 2.60's ``services.start_raylet`` spells it."""
    import ray

    script = os.path.join(os.path.dirname(ray.__file__), "dashboard", "agent.py")
    return subprocess.list2cmdline(
        [sys.executable, script, f"--node-id={NODE_ID}", f"--session-dir={session_dir}", "--x"]
    )


def test_the_agent_command_runs_the_placeholder_with_rays_arguments() -> None:
    rewritten = shlex.split(ray_boot.stub_agent_command(_ray_agent_command("/tmp/a session")))
    assert rewritten == [
        sys.executable,
        ray_agent_stub.__file__,
        f"--node-id={NODE_ID}",
        "--session-dir=/tmp/a session",
        "--x",
    ]


def test_a_command_that_is_not_rays_agent_is_refused_by_name() -> None:
    with pytest.raises(ray_boot.RayBootError, match="dashboard agent command names"):
        ray_boot.stub_agent_command("python -m something.else --node-id=x")


@pytest.mark.parametrize("count", [0, 2])
def test_a_raylet_command_without_exactly_one_agent_command_is_refused(count: int) -> None:
    argv = ["raylet", "--node_id=x"] + [ray_boot.AGENT_FLAG + _ray_agent_command("/s")] * count
    with pytest.raises(ray_boot.RayBootError, match=f"has {count} "):
        ray_boot.raylet_argv(argv)


def test_port_files_named_otherwise_than_the_placeholder_does_are_refused() -> None:
    with pytest.raises(ray_boot.RayBootError, match="port file"):
        ray_boot.check_port_files(lambda node, name: f"{node}_{name}", ray_agent_stub.PORT_NAMES)


def test_installed_on_this_ray_only_the_raylets_command_is_rewritten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray._private.services as services

    started: list[tuple[list[str], str]] = []

    def start_ray_process(command: list[str], process_type: str, **_: Any) -> None:
        started.append((command, process_type))

    monkeypatch.setattr(services, "start_ray_process", start_ray_process)
    rewritten = ray_boot.install()  # checks this Ray's port names and files first
    agent = ray_boot.AGENT_FLAG + _ray_agent_command("/s")
    services.start_ray_process(["raylet", agent], "raylet", fate_share=False)
    services.start_ray_process(["gcs_server", agent], "gcs_server", fate_share=False)
    (raylet, _), (gcs, _) = started
    assert ray_agent_stub.__file__ in raylet[1] and "agent.py" not in raylet[1]
    assert gcs == ["gcs_server", agent]  # any other process as Ray built it
    assert rewritten == [raylet]  # what the node's start checks: one raylet, rewritten


def test_the_placeholder_persists_the_ports_for_ray_and_ends_with_its_raylet(
    tmp_path: Path,
) -> None:
    from ray._raylet import wait_for_persisted_port  # type: ignore[attr-defined]

    command = shlex.split(ray_boot.stub_agent_command(_ray_agent_command(str(tmp_path))))
    # the "raylet": starts the placeholder, says its pid, then lives until its stdin closes
    raylet = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; child = subprocess.Popen(sys.argv[1:]); "
            "print(child.pid, flush=True); sys.stdin.read()",
            *command,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert raylet.stdin is not None and raylet.stdout is not None
    stub = int(raylet.stdout.readline())
    try:
        for name in ray_agent_stub.PORT_NAMES:
            assert wait_for_persisted_port(str(tmp_path), NODE_ID, name, timeout_ms=20_000) == -1
        assert os.path.exists(f"/proc/{stub}")  # lives while the raylet does
        raylet.stdin.close()
        raylet.wait(HANG_S)
        deadline = time.monotonic() + HANG_S
        while _alive(stub) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(stub)
    finally:
        raylet.kill()
        raylet.wait()
        if _alive(stub):
            os.kill(stub, 9)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie of an init that does not reap counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_worker_pods_node_starts_through_the_boot_module() -> None:
    argv = worker_argv("10.0.0.1:6379", "10.0.0.2", 1, None)
    assert argv[:3] == [sys.executable, "-m", BOOT_MODULE]
    assert argv[3] == "start" and "--block" in argv
    assert ray_boot.parse_start(argv[3:]).address == "10.0.0.1:6379"


def test_the_worker_nodes_arguments_are_read_and_any_other_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = worker_argv("10.0.0.1:6379", "10.0.0.2", 2, 1, 0)[3:]  # after "python -m ray_boot"
    args = ray_boot.parse_start(argv)
    assert (args.address, args.node_ip_address, args.num_cpus, args.num_gpus) == (
        "10.0.0.1:6379",
        "10.0.0.2",
        1,
        0,
    )
    assert args.resources == {RAY_GENERATION_RESOURCE: 2}
    assert args.include_log_monitor == "false" and args.block
    with pytest.raises(SystemExit):
        ray_boot.parse_start([*argv, "--head"])  # not Ray's CLI: a flag it does not know
    assert "unrecognized arguments: --head" in capsys.readouterr().err


def test_only_a_process_that_ended_other_than_stopped_ends_the_node() -> None:
    class Ended:
        def __init__(self, code: int) -> None:
            self.returncode = code

    stopped = [("raylet", Ended(0)), ("reaper", Ended(-15)), ("agent", Ended(143))]
    assert ray_boot.unexpected_exits(stopped) == []
    assert ray_boot.unexpected_exits([*stopped, ("raylet", Ended(-9))]) == ["raylet (-9)"]
