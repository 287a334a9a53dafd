"""``rolloutrun operator``: run the RolloutRun operator (Kopf) against the current cluster.

Why light: the ``rolloutrun`` dispatcher imports every ``register`` function to build its
help, so this module imports only argparse; Kopf and the handlers load when the command runs.
Standalone by default (one replica, no peering objects); ``--peering NAME --priority N`` lets
several replicas run with Kopf's peering, the highest priority active and the others paused.
"""

from __future__ import annotations

import argparse


def _run_operator(args: argparse.Namespace) -> int:
    import asyncio
    import os

    import kopf

    from rolloutrun_operator import handlers

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # Kopf's login reads it too
    namespaces = list(args.namespace or [])
    options = handlers.Options(
        kubeconfig=args.kubeconfig,
        metrics_port=args.metrics_port if args.metrics_port > 0 else None,
        metrics_address=args.metrics_address,
    )
    peering = args.peering is not None
    asyncio.run(
        kopf.operator(
            registry=handlers.registry,
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=not peering,
            peering_name=args.peering,
            priority=args.priority if peering else None,
            liveness_endpoint=args.liveness,
            memo=kopf.Memo(options=options),
        )
    )
    return 0


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
        "--liveness",
        metavar="URL",
        help="Kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.set_defaults(handler=_run_operator)
