"""``rolloutrun gym``: the Gym pod's entry point (one environment server replica).

Why a READY line: the local launcher and the tests start replicas as subprocesses on port 0
and need the bound URL; printing ``READY <url>`` once the socket listens is the cheapest
handshake that works the same on a laptop and in a pod. SIGTERM (pod deletion, preemption)
stops the server cleanly: audit-file lines are fsynced and ``--audit-uri`` objects written
before their effect is applied, so nothing is lost. A side-effect store that cannot be read
at startup (bucket missing, no permission, an audit file another writer still holds after
:data:`AUDIT_LOCK_WAIT_S`) exits 1 before serving: a replica that cannot tell which effects
the run applied must not run episodes.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutrun_runtime.contract.pod import ENV_POD_NAME

if TYPE_CHECKING:
    from rolloutrun_runtime.contract.run_config import RunConfig
    from rolloutrun_runtime.environments.gym.effects import SideEffectLog

#: How long a replica waits for its audit file's previous writer (a replaced pod that is
#: still exiting) before it gives up naming that writer.
AUDIT_LOCK_WAIT_S = 30.0


def register(parser: argparse.ArgumentParser) -> None:
    """Serve one Gym environment replica; prints READY <url> when listening."""
    parser.add_argument("--config", required=True, help="RolloutRun or bare RunConfig YAML")
    parser.add_argument("--port", type=int, required=True, help="port (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--instance-id",
        default=None,
        help="stable replica id (default: $POD_NAME, else <hostname>-<port>)",
    )
    audit = parser.add_mutually_exclusive_group()
    audit.add_argument(
        "--audit-file",
        default=None,
        help="append every applied side effect here (JSON lines, fsynced; checked against "
        "every *.audit.jsonl of its directory, the run's other replicas)",
    )
    audit.add_argument(
        "--audit-uri",
        default=None,
        help="record every side effect, before applying it, as a create-only object under "
        "this storage URI (file:///dir or gs://bucket/prefix), shared by the run's replicas: "
        "<uri>/<rollout-id>/<revision>.json",
    )
    parser.set_defaults(handler=run)


def default_instance_id(port: int) -> str:
    """``$POD_NAME``, else ``<hostname>-<port>`` (``<hostname>-pid<pid>`` for port 0).

    Launchers should pass ``--instance-id``: a turn-level restore must find the same
    replica again, so the id must survive the replica's restart.
    """
    suffix = str(port) if port else f"pid{os.getpid()}"
    return os.environ.get(ENV_POD_NAME) or f"{socket.gethostname()}-{suffix}"


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM; the cyclic GC is off until the server listens (see
    :func:`_freeze_startup_objects`)."""
    import gc

    gc.disable()
    try:
        return _start(args)
    finally:
        gc.enable()


def _start(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from rolloutrun_runtime.contract.run_config import (
        UNRESTORABLE_EXIT_CODE,
        ConfigError,
        load_run_config,
    )
    from rolloutrun_runtime.environments.gym.effects import SideEffectLog, open_effect_store
    from rolloutrun_runtime.pod import resolve_config_path, take_gym_token
    from rolloutrun_runtime.storage import StorageError

    token = take_gym_token()  # first: no child process of this replica inherits it
    try:
        cfg = load_run_config(resolve_config_path(args.config))  # the local cluster's pod root
    except ConfigError as error:
        print(f"rolloutrun gym: {error}", file=sys.stderr)
        return 2
    if cfg.task.name == "external":
        print(
            "rolloutrun gym: task.name external is served by the user's own environment server "
            "(spec.gym.command; docs/environment-contract.md), not the built-in Gym",
            file=sys.stderr,
        )
        return 2
    problem = model_problem(cfg)
    if problem:  # a restart finds the same model: the configuration's exit, one line
        print(f"rolloutrun gym: {problem}", file=sys.stderr)
        return UNRESTORABLE_EXIT_CODE

    instance_id = args.instance_id or default_instance_id(args.port)
    audit = Path(args.audit_file) if args.audit_file else None
    try:
        store = open_effect_store(
            instance_id, audit_file=audit, audit_uri=args.audit_uri, lock_wait_s=AUDIT_LOCK_WAIT_S
        )
        effects = SideEffectLog(instance_id, store=store)
    except (StorageError, OSError, ValueError) as error:
        logging.getLogger(__name__).error("gym side-effect store unusable: %s", error)
        print(f"rolloutrun gym: side-effect store: {error}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_serve(cfg, args.host, args.port, instance_id, effects, token))
    except OSError as error:
        logging.getLogger(__name__).error("gym server failed: %s", error)
        print(f"rolloutrun gym: {error}", file=sys.stderr)
        return 1


def model_problem(cfg: RunConfig) -> str | None:
    """Why the Gym cannot tokenize with ``policy.model`` (missing, incomplete, an unreadable
    ``tokenizer.json``, no chat template where one is asked for), or None. The tokenizer is
    read here once (it is cached), so a bad model is one named line at start, not a
    traceback out of the server's start-up."""
    from rolloutrun_runtime.contract.model_dir import local_model_problem
    from rolloutrun_runtime.policy.hf_files import HFModelError
    from rolloutrun_runtime.policy.tokenizer import TokenizerError, policy_tokenizer

    if cfg.policy.model is None:
        return None
    problem = local_model_problem(cfg.policy.model)
    if problem:
        return problem
    try:
        policy_tokenizer(cfg.policy)
    except (HFModelError, TokenizerError) as error:
        return str(error)
    return None


async def _serve(
    cfg: RunConfig,
    host: str,
    port: int,
    instance_id: str,
    effects: SideEffectLog,
    token: str | None,
) -> int:
    import asyncio
    import logging
    import signal

    from rolloutrun_runtime.environments.gym import GymServer
    from rolloutrun_runtime.environments.gym.control import GymCheckpointControl
    from rolloutrun_runtime.policy.http import serve_app

    logger = logging.getLogger(__name__)
    server = GymServer(instance_id, cfg, effects=effects, token=token)
    control = GymCheckpointControl(server, token)  # None: the control plane is disabled
    server.continue_restored = control.claim_restored
    runner, url = await serve_app(server.app, host, port, cancel_on_disconnect=True)
    _freeze_startup_objects()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"READY {url}", flush=True)
    cpu, since = startup_cost()
    logger.info(
        "gym %s listening on %s (start-up: %.3f s CPU, %s s since its process started)",
        server.instance_id,
        url,
        cpu,
        "?" if since is None else f"{since:.3f}",
    )
    try:
        await stop.wait()
    finally:
        logger.info("gym %s stopping", server.instance_id)
        await runner.cleanup()
        logger.info("gym %s stopped", server.instance_id)  # its episodes in flight ended
    return 0


def startup_cost(stat: str | None = None, now_s: float | None = None) -> tuple[float, float | None]:
    """This process's CPU seconds so far (user + system, what it ran before its ``exec``
    too: the pod's launcher) and the seconds since it was forked (None where ``/proc`` does
    not say). Logged with "listening on": a replacement's start-up on a busy node is CPU it
    needs or CPU it waited for, and only these two tell which (``bench/elastic.py``)."""
    times = os.times()
    cpu = times.user + times.system
    try:
        stat = Path("/proc/self/stat").read_text() if stat is None else stat
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime
        now_s = time.clock_gettime(time.CLOCK_BOOTTIME) if now_s is None else now_s
    except (OSError, IndexError, ValueError, AttributeError):
        return cpu, None
    return cpu, max(now_s - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def _freeze_startup_objects() -> None:
    """Start-up (aiohttp, pydantic's models, the configuration) leaves ~50k long-lived
    objects. The GC is off while they are made (:func:`run`): each automatic pass on the way
    walked the growing heap again (~90 passes, ~10 % of the start-up's CPU), for nothing.
    They are frozen out of future passes, then the GC is on again. No collection first: a
    full pass costs 25-45 ms of CPU before the replica serves, to free ~2k objects start-up
    leaves in unreachable cycles (classes and functions of attrs', pydantic's and enum's
    class builders; no files or sockets), a one-time few hundred KB that stay frozen."""
    import gc

    gc.freeze()
    gc.enable()
