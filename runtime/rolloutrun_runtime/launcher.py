"""``rolloutrun train FILE --log-dir DIR``: a whole run on one machine, no Kubernetes.

Why a launcher: the cluster runs the trainer and each Gym replica in its own pod; locally
the same processes are started here instead: ``gym.replicas`` Gym servers (and
``gym.standby`` more) as child processes (each in its own process group, so a Ctrl-C or a
crash of the trainer never leaves one behind), then the trainer in this process with
``gym.endpoints`` filled in. One progress line per train step goes to the terminal; every
step is also in ``DIR/metrics.jsonl``.

A RolloutRun whose ``spec.gym.command`` names the user's own environment server
(docs/environment-contract.md) gets that command as its replicas instead, with the
variables a Gym pod gives it (``POD_IP`` 127.0.0.1, ``ROLLOUTRUN_GYM_PORT`` a free port,
the instance id and the token; ``$(VAR)`` expanded as the kubelet does); it is ready when
its ``/healthz`` answers.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rolloutrun_runtime.contract.pod import (
    ENV_GYM_INSTANCE_ID,
    ENV_GYM_PORT,
    ENV_GYM_TOKEN,
    ENV_POD_IP,
)
from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE

#: Seconds a Gym replica may take to print its READY line.
GYM_START_TIMEOUT_S = 120.0
#: Seconds between SIGTERM and SIGKILL when stopping a Gym replica.
GYM_STOP_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A Gym replica did not start."""


@dataclass
class GymProcess:
    instance_id: str
    process: subprocess.Popen[str]
    url: str
    log: IO[str]


def register(parser: argparse.ArgumentParser) -> None:
    """Run a RolloutRun locally: start its Gym replicas, train to maxSteps, stop them."""
    parser.add_argument("file", help="RolloutRun YAML (its spec.run) or a bare RunConfig")
    parser.add_argument("--log-dir", default=None, help="override run.logDir")
    parser.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show log records below WARNING on the terminal (DIR/trainer.log has them)",
    )
    parser.set_defaults(handler=main)


def start_gym(
    config_file: Path, log_dir: Path, index: int, gym_token: str | None = None
) -> GymProcess:
    """Start one ``rolloutrun gym`` replica on a free port and wait for its READY line.

    ``gym_token`` goes into that replica's environment only (the replica takes it out of
    its own at startup); this process's environment never holds it.
    """
    instance_id = f"gym-{index}"
    log = (log_dir / f"{instance_id}.log").open("a")
    command = [
        sys.executable,
        "-m",
        "rolloutrun_runtime.cli",
        "gym",
        "--config",
        str(config_file),
        "--port",
        "0",
        "--instance-id",
        instance_id,
        "--audit-file",
        str(log_dir / f"{instance_id}.audit.jsonl"),
    ]
    env = dict(os.environ)
    if gym_token is not None:
        env[ENV_GYM_TOKEN] = gym_token
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True, env=env
    )
    deadline = time.monotonic() + GYM_START_TIMEOUT_S
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith("READY "):
            return GymProcess(instance_id, process, line.split(None, 1)[1].strip(), log)
    stop_process(process)
    log.close()
    raise LaunchError(
        f"Gym replica {instance_id} did not print READY (exit {process.returncode}); "
        f"see {log_dir / (instance_id + '.log')}"
    )


def user_server_command(config_file: Path) -> list[str] | None:
    """``spec.gym.command`` + ``args`` of a RolloutRun file; None: the built-in Gym."""
    from rolloutrun_runtime.contract.kube_yaml import load_yaml

    document = load_yaml(config_file.read_text())
    if not isinstance(document, dict) or document.get("kind") != "RolloutRun":
        return None
    gym = (document.get("spec") or {}).get("gym") or {}
    if not isinstance(gym, dict) or not gym.get("command"):
        return None
    return [str(part) for part in [*gym["command"], *(gym.get("args") or [])]]


def expand(part: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names expand, ``$$`` escapes, others stay."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        part,
    )


def start_user_gym(
    command: list[str], log_dir: Path, index: int, gym_token: str | None
) -> GymProcess:
    """Start one replica of the user's server on a free loopback port; wait for /healthz."""
    instance_id = f"gym-{index}"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        ENV_POD_IP: "127.0.0.1",
        ENV_GYM_PORT: str(port),
        ENV_GYM_INSTANCE_ID: instance_id,
    }
    if gym_token is not None:
        env[ENV_GYM_TOKEN] = gym_token
    log = (log_dir / f"{instance_id}.log").open("a")
    argv = [expand(part, env) for part in command]
    try:
        process = subprocess.Popen(
            argv, stdout=log, stderr=log, text=True, start_new_session=True, env=env
        )
    except OSError as error:
        log.close()
        raise LaunchError(f"Gym replica {instance_id}: cannot run {argv[0]!r}: {error}") from error
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + GYM_START_TIMEOUT_S
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(url + HEALTHZ_ROUTE, timeout=2) as answer:
                if answer.status == 200:
                    return GymProcess(instance_id, process, url, log)
        except OSError:
            time.sleep(0.2)
    stop_process(process)
    log.close()
    raise LaunchError(
        f"Gym replica {instance_id} ({' '.join(argv)}) did not answer {url}{HEALTHZ_ROUTE} "
        f"(exit {process.returncode}); see {log_dir / (instance_id + '.log')}"
    )


def route_logs(log_dir: Path, verbose: bool) -> logging.Handler:
    """Log records go to ``DIR/trainer.log``; the terminal shows WARNING and up unless verbose.

    The progress lines already say what a healthy run does; INFO records (refits, checkpoint
    publications) would bury them.
    """
    root = logging.getLogger()
    handler = logging.FileHandler(log_dir / "trainer.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    if not verbose:
        for other in root.handlers:
            if type(other) is logging.StreamHandler:
                other.setLevel(max(other.level, logging.WARNING))
    return handler


def stop_process(process: subprocess.Popen[str]) -> None:
    """SIGTERM the process group, then SIGKILL it after the grace period."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=GYM_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def main(args: argparse.Namespace) -> int:
    import asyncio

    from rolloutrun_runtime.algorithms.single_controller.hooks import OnStep
    from rolloutrun_runtime.contract.model_dir import local_model_problem
    from rolloutrun_runtime.contract.run_config import ConfigError, load_run_config
    from rolloutrun_runtime.metrics import format_progress
    from rolloutrun_runtime.policy.hf_files import HFModelError
    from rolloutrun_runtime.prompt_data import PromptDataError
    from rolloutrun_runtime.storage import StorageError
    from rolloutrun_runtime.trainer import run_trainer

    config_file = Path(args.file)
    try:
        cfg = load_run_config(config_file)
    except ConfigError as error:
        print(f"rolloutrun train: {error}", file=sys.stderr)
        return 2
    if args.log_dir:
        cfg = cfg.model_copy(update={"log_dir": str(args.log_dir)})
    problem = cfg.policy.model and local_model_problem(cfg.policy.model)
    if problem:  # before any Gym starts: one line, not a traceback from the model's load
        print(f"rolloutrun train: {problem}", file=sys.stderr)
        return 2
    log_dir = Path(cfg.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_handler = route_logs(log_dir, args.verbose)
    gyms: list[GymProcess] = []
    # The run's token (Gym /run and control plane, generation): new per launch, handed to
    # the Gym replicas (in their environment only) and to the trainer (this process, as an
    # argument): never in this process's environment, which every child would inherit.
    os.environ.pop(ENV_GYM_TOKEN, None)
    gym_token = secrets.token_hex(16)
    user_command = user_server_command(config_file)
    try:
        for index in range(cfg.gym.servers):  # the active replicas, then the standbys
            if user_command is not None:  # the user's own environment server
                gyms.append(start_user_gym(user_command, log_dir, index, gym_token))
            else:
                gyms.append(start_gym(config_file, log_dir, index, gym_token))
        gym = cfg.gym.model_copy(update={"endpoints": [g.url for g in gyms]})
        cfg = cfg.model_copy(update={"gym": gym})
        print(
            f"rolloutrun train: {cfg.name}: {len(gyms)} Gym replicas, {cfg.grpo.max_steps} steps, "
            f"logs in {log_dir}",
            flush=True,
        )

        def progress(record: dict) -> None:
            if not args.quiet:
                print(format_progress(record, cfg.grpo.max_steps), flush=True)

        result = asyncio.run(run_trainer(cfg, hooks=OnStep(progress), gym_token=gym_token))
    except LaunchError as error:
        print(f"rolloutrun train: {error}", file=sys.stderr)
        return 1
    except (RuntimeError, StorageError, PromptDataError, HFModelError) as error:
        # Controller, ledger, checkpoint and storage errors name their problem; the
        # traceback is in the log at DEBUG.
        logging.getLogger(__name__).debug("run failed", exc_info=error)
        print(f"rolloutrun train: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        for gym_process in gyms:
            stop_process(gym_process.process)
            gym_process.log.close()
        logging.getLogger().removeHandler(log_handler)
        log_handler.close()
    if result.resumed_from:
        print(f"resumed from {result.resumed_from}", flush=True)
    print(f"done: step {result.steps}; final weights sha256 {result.final_weights_sha256}")
    return 0
