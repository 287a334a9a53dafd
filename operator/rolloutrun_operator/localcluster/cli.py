"""``rolloutrun cluster``: run the local cluster in the foreground.

Kept light: the cluster's modules (aiohttp and friends) are imported only when the command
runs, so loading the subcommand for ``rolloutrun --help`` stays cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path


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
    up.set_defaults(handler=cluster_up)


def cluster_up(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args.dir, args.port, args.token))


async def _serve(directory: Path, port: int, token: str | None) -> int:
    from .cluster import LocalCluster

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    cluster = LocalCluster(directory, port=port, token=token)
    await cluster.astart()
    print(f"API server:  {cluster.api_url}", flush=True)
    print(f"kubeconfig:  {cluster.kubeconfig_path}", flush=True)
    print(f"try:         kubectl --kubeconfig {cluster.kubeconfig_path} get nodes", flush=True)
    try:
        await stop.wait()
    finally:
        print("stopping the local cluster and its pods", flush=True)
        await cluster.astop()
    return 0
