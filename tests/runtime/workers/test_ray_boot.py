"""A worker node's ``ray start`` with Ray's dashboard and runtime-env agents replaced by
placeholders (:mod:`rolloutrun_runtime.workers.ray_boot`,
:mod:`rolloutrun_runtime.workers.ray_agent_stub`).

The placeholders are real processes here: they persist the agents' ports where Ray's own
reader (``ray._raylet.wait_for_persisted_port``) finds them, the runtime-env one answers on
its port, and each ends with the process that started it (the raylet). The rewrite of the
raylet's command is checked against this Ray, and each assumption it rests on fails by name
when it no longer holds. A whole worker node started this way hosts an actor and refuses a
``runtime_env`` by name in ``test_ray_runtime_env_refused.py``, and reports its loss in
``test_ray_node_loss.py`` (chaos).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.contract.pod import RAY_GENERATION_RESOURCE
from rolloutrun_runtime.workers import ray_agent_stub, ray_boot
from rolloutrun_runtime.workers.ray_node import BOOT_MODULE, worker_argv

NODE_ID = "ab" * 28
#: Only a hang guard: the placeholder looks at its parent every PARENT_POLL_S.
HANG_S = 30


def _ray_agent_command(session_dir: str, script: str = ray_boot.RAY_AGENT_SCRIPT) -> str:
    """An agent's command line as Ray 2.60's ``services.start_raylet`` spells it."""
    import ray

    path = os.path.join(os.path.dirname(ray.__file__), script)
    return subprocess.list2cmdline(
        [sys.executable, path, f"--node-id={NODE_ID}", f"--session-dir={session_dir}", "--x"]
    )


def _runtime_env_command(session_dir: str) -> str:
    return _ray_agent_command(session_dir, ray_boot.RAY_RUNTIME_ENV_AGENT_SCRIPT)


def _raylet(dashboard: int = 1, runtime_env: int = 1) -> list[str]:
    """A raylet's command with that many of each agent's command."""
    return [
        "raylet",
        "--node_id=x",
        *[ray_boot.AGENT_FLAG + _ray_agent_command("/s")] * dashboard,
        *[ray_boot.RUNTIME_ENV_AGENT_FLAG + _runtime_env_command("/s")] * runtime_env,
    ]


def test_the_agent_command_runs_the_placeholder_with_rays_arguments() -> None:
    rewritten = shlex.split(ray_boot.stub_agent_command(_ray_agent_command("/tmp/a session")))
    assert rewritten == [
        sys.executable,
        ray_agent_stub.__file__,
        "--stub=dashboard",
        f"--node-id={NODE_ID}",
        "--session-dir=/tmp/a session",
        "--x",
    ]


def test_the_raylet_gets_both_placeholders_and_keeps_its_other_arguments() -> None:
    argv = ray_boot.raylet_argv(_raylet())
    assert argv[:2] == ["raylet", "--node_id=x"]
    dashboard = shlex.split(argv[2][len(ray_boot.AGENT_FLAG) :])
    runtime_env = shlex.split(argv[3][len(ray_boot.RUNTIME_ENV_AGENT_FLAG) :])
    assert dashboard[1:3] == [ray_agent_stub.__file__, "--stub=dashboard"]
    assert runtime_env[1:3] == [ray_agent_stub.__file__, "--stub=runtime-env"]
    assert runtime_env[3:] == [f"--node-id={NODE_ID}", "--session-dir=/s", "--x"]


def test_a_command_that_is_not_rays_agent_is_refused_by_name() -> None:
    with pytest.raises(ray_boot.RayBootError, match="dashboard agent command names"):
        ray_boot.stub_agent_command("python -m something.else --node-id=x")
    with pytest.raises(ray_boot.RayBootError, match="runtime-env agent command names"):
        ray_boot.raylet_argv(
            [ray_boot.AGENT_FLAG + _ray_agent_command("/s"), ray_boot.RUNTIME_ENV_AGENT_FLAG + "x"]
        )


@pytest.mark.parametrize(
    ("dashboard", "runtime_env", "flag"),
    [
        (0, 1, ray_boot.AGENT_FLAG),
        (2, 1, ray_boot.AGENT_FLAG),
        (1, 0, ray_boot.RUNTIME_ENV_AGENT_FLAG),
        (1, 2, ray_boot.RUNTIME_ENV_AGENT_FLAG),
    ],
)
def test_a_raylet_command_without_exactly_one_of_each_agent_command_is_refused(
    dashboard: int, runtime_env: int, flag: str
) -> None:
    count = dashboard if flag == ray_boot.AGENT_FLAG else runtime_env
    with pytest.raises(ray_boot.RayBootError, match=f"has {count} '{flag}'"):
        ray_boot.raylet_argv(_raylet(dashboard, runtime_env))


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
    services.start_ray_process(_raylet(), "raylet", fate_share=False)
    services.start_ray_process(_raylet(), "gcs_server", fate_share=False)
    (raylet, _), (gcs, _) = started
    assert all(ray_agent_stub.__file__ in arg for arg in raylet[2:])
    assert not any("agent.py" in arg or "agent/main.py" in arg for arg in raylet)
    assert gcs == _raylet()  # any other process as Ray built it
    assert rewritten == [raylet]  # what the node's start checks: one raylet, rewritten


@contextlib.contextmanager
def _under_a_raylet(command: list[str]) -> Iterator[int]:
    """``command`` started by a stand-in raylet (it says the child's pid, then lives until
    its stdin closes); yields the child's pid, and on leaving checks that the child ended
    with its raylet."""
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
        yield stub
        assert _alive(stub)  # lives while the raylet does
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


def test_the_placeholder_persists_the_ports_for_ray_and_ends_with_its_raylet(
    tmp_path: Path,
) -> None:
    from ray._raylet import wait_for_persisted_port  # type: ignore[attr-defined]

    command = shlex.split(ray_boot.stub_agent_command(_ray_agent_command(str(tmp_path))))
    with _under_a_raylet(command):
        for name in ray_agent_stub.PORT_NAMES:
            assert wait_for_persisted_port(str(tmp_path), NODE_ID, name, timeout_ms=20_000) == -1


def test_the_runtime_env_placeholder_serves_its_port_and_refuses_by_name(
    tmp_path: Path,
) -> None:
    import urllib.error
    import urllib.request

    from ray._raylet import wait_for_persisted_port  # type: ignore[attr-defined]

    ray_command = _runtime_env_command(str(tmp_path)) + " --node-ip-address=127.0.0.1"
    command = shlex.split(
        ray_boot.stub_agent_command(
            ray_command, ray_boot.RAY_RUNTIME_ENV_AGENT_SCRIPT, ray_agent_stub.RUNTIME_ENV
        )
    )
    with _under_a_raylet(command):
        name = ray_agent_stub.RUNTIME_ENV_PORT_NAME
        port = wait_for_persisted_port(str(tmp_path), NODE_ID, name, timeout_ms=20_000)
        assert port > 0
        asked = urllib.request.Request(
            f"http://127.0.0.1:{port}/get_or_create_runtime_env", data=b"\x0a\x00"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(asked, timeout=HANG_S)
        assert refused.value.code == 501
        assert refused.value.read() == ray_agent_stub.NO_RUNTIME_ENV


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
