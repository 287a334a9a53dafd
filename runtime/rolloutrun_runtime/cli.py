"""The ``rolloutrun`` command: a thin dispatcher over plug-in subcommands.

Why plug-ins: the operator image installs no torch and the runtime image must never import
kopf, yet one console script serves both. Each subcommand is an entry point in the group
``rolloutrun.commands`` whose value is a ``register(parser)`` function; the dispatcher loads
them by name, so the heavy imports happen only inside the chosen command's handler. Only
the command being run is loaded (``rolloutrun trainer`` never imports the operator, the
local cluster or kopf); ``--help``, no command or an unknown one loads them all, to list them.

A ``register`` function fills in its ``argparse`` parser (the first line of its docstring
is the one-line help) and sets ``parser.set_defaults(handler=callable)``; the handler takes
the parsed namespace and returns an exit code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from rolloutrun_runtime import __version__

COMMAND_GROUP = "rolloutrun.commands"

Register = Callable[[argparse.ArgumentParser], None]


def _unavailable(name: str, error: Exception) -> Register:
    """A stand-in command that explains why the real one cannot load (e.g. the operator
    image has no torch), so one broken plug-in does not take every command down."""

    def register(parser: argparse.ArgumentParser) -> None:
        def fail(_args: argparse.Namespace) -> int:
            print(
                f"rolloutrun {name}: unavailable in this installation: {error}",
                file=sys.stderr,
            )
            return 3

        parser.set_defaults(handler=fail)

    register.__doc__ = f"(unavailable: {type(error).__name__})"
    return register


def _load_commands(only: str | None = None) -> dict[str, Register]:
    """Every command's ``register``, or only the command ``only`` when it exists."""
    entries = entry_points(group=COMMAND_GROUP)
    if only is not None and only in entries.names:
        entries = entries.select(name=only)
    commands: dict[str, Register] = {}
    for entry in entries:
        try:
            commands[entry.name] = entry.load()
        except ImportError as error:
            commands[entry.name] = _unavailable(entry.name, error)
    return dict(sorted(commands.items()))


def command_named(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs: its first word that is not an option (``--log-level``
    takes a value); None when an option such as ``--help`` or ``--version`` comes first."""
    words = list(argv)
    while words:
        word = words.pop(0)
        if word == "--log-level":
            words = words[1:]
        elif not word.startswith("--log-level="):
            return None if word.startswith("-") else word
    return None


def build_parser(
    commands: dict[str, Register] | None = None, *, only: str | None = None
) -> argparse.ArgumentParser:
    commands = _load_commands(only) if commands is None else commands
    parser = argparse.ArgumentParser(
        prog="rolloutrun",
        description=(
            "Preemption-proof async RL post-training: run it locally, on the local cluster, "
            "or as a Kubernetes operator."
        ),
    )
    parser.add_argument("--version", action="version", version=f"rolloutrun {__version__}")
    parser.add_argument(
        "--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING, ERROR)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, register in commands.items():
        summary = (register.__doc__ or "").strip().splitlines()
        help_line = summary[0] if summary else ""
        command_parser = sub.add_parser(name, help=help_line, description=help_line)
        register(command_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only=command_named(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
