"""``rolloutrun cluster``: run the local cluster in the foreground.

Kept light: the cluster's modules (aiohttp and friends) are imported only when the command
runs, so loading the subcommand for ``rolloutrun --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any


def register_cli(parser: argparse.ArgumentParser) -> None:
    """Run a local Kubernetes cluster (API server emulator + process kubelet)."""
    sub = parser.add_subparsers(dest="cluster_command", metavar="ACTION", required=True)
    up = sub.add_parser(
        "up", help="start the cluster in the foreground; Ctrl-C stops it and its pods"
    )
    up.add_argument(
        "--dir",
        type=Path,
        default=Path(".rolloutrun/cluster"),
        help="state directory (kubeconfig, pod dirs)",
    )
    up.add_argument(
        "--port", type=int, default=0, help="API port on 127.0.0.1 (default: a free one)"
    )
    up.add_argument("--token", default=None, help="bearer token (default: a random one)")
    up.add_argument(
        "--pod-network",
        default="127.0.0.0/16",
        help="loopback /16 the pod IPs come from (default: 127.0.0.0/16)",
    )
    up.add_argument("--nodes", type=int, default=1, help="number of process kubelets (nodes)")
    up.add_argument(
        "--network",
        choices=("namespaces", "loopback", "auto"),
        default=None,
        help="pod network: a namespace per pod, or the shared loopback "
        "(default: $ROLLOUTRUN_LOCALCLUSTER_NETWORK, else auto: namespaces if permitted)",
    )
    up.set_defaults(handler=cluster_up)


def cluster_up(args: argparse.Namespace) -> int:
    options = {"pod_network": args.pod_network, "nodes": args.nodes, "network": args.network}
    return asyncio.run(_serve(args.dir, args.port, args.token, options))


async def _serve(directory: Path, port: int, token: str | None, options: dict[str, Any]) -> int:
    from .cluster import LocalCluster

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = LocalCluster(directory, port=port, token=token, pace_gc=True, **options)
    await cluster.astart()
    print(f"API server:  {cluster.api_url}", flush=True)
    print(f"kubeconfig:  {cluster.kubeconfig_path}", flush=True)
    if cluster.network is not None:
        print(f"pod network: {cluster.network.description}", flush=True)
    print(f"try:         kubectl --kubeconfig {cluster.kubeconfig_path} get nodes", flush=True)
    try:
        await stop.wait()
    finally:
        print("stopping the local cluster and its pods", flush=True)
        await cluster.astop()
    return 0
