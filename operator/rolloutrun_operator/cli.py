"""``rolloutrun operator``: run the RolloutRun operator (Kopf) against the current cluster.

Why light: the ``rolloutrun`` dispatcher imports every ``register`` function to build its
help, so this module imports only argparse; Kopf and the handlers load when the command runs.
Standalone by default (one replica, no peering objects); ``--peering NAME --priority N`` lets
several replicas run with Kopf's peering, the highest priority active and the others paused.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutrun_operator.runner import OperatorConfig


def _run_operator(args: argparse.Namespace) -> int:
    import asyncio

    from rolloutrun_operator.gc_pacing import with_paced_gc
    from rolloutrun_operator.metrics import token_problem
    from rolloutrun_operator.runner import run_operator

    config = operator_config(args)
    if config.options.metrics_port is not None:  # the token file is there (the pod's mount)
        problem = token_problem(args.metrics_address, args.metrics_token_file)
        if problem is not None:
            raise SystemExit(f"rolloutrun operator: {problem}")
    asyncio.run(with_paced_gc(run_operator(config)))  # no full GC pass inside a reaction
    return 0


def operator_config(args: argparse.Namespace) -> OperatorConfig:
    """The command's options as the runner's config (the chart's args, tested as such)."""
    from rolloutrun_operator.handlers import Options
    from rolloutrun_operator.metrics import token_problem
    from rolloutrun_operator.runner import OperatorConfig

    if args.metrics_port > 0:
        problem = token_problem(args.metrics_address, args.metrics_token_file, read=False)
        if problem is not None:
            raise SystemExit(f"rolloutrun operator: {problem}")
    return OperatorConfig(
        options=Options(
            kubeconfig=args.kubeconfig,
            metrics_port=args.metrics_port if args.metrics_port > 0 else None,
            metrics_address=args.metrics_address,
            metrics_token_file=args.metrics_token_file,
        ),
        namespaces=list(args.namespace or []),
        peering=args.peering,
        priority=args.priority,
        liveness=args.liveness,
    )


def register_operator(parser: argparse.ArgumentParser) -> None:
    """Run the RolloutRun operator (Kopf): reconcile runs, restart them after member loss."""
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        metavar="NS",
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig file; default: in-cluster, $KUBECONFIG")
    parser.add_argument(
        "--peering",
        metavar="NAME",
        help="join Kopf peering NAME (several replicas, one active); default: standalone",
    )
    parser.add_argument(
        "--priority", type=int, default=0, help="peering priority; the highest one is active"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=9090,
        help="serve Prometheus metrics on this port (0: off)",
    )
    parser.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        help="address the metrics server binds (0.0.0.0 in a cluster)",
    )
    parser.add_argument(
        "--metrics-token-file",
        metavar="FILE",
        help="scrapers must send 'Authorization: Bearer <the token in FILE>' (read at each "
        "scrape); required unless --metrics-address is loopback",
    )
    parser.add_argument(
        "--liveness",
        metavar="URL",
        help="Kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.set_defaults(handler=_run_operator)
