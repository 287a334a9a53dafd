"""The `rolloutrun` dispatcher: plug-in subcommands, help, and a clear exit on no command."""

from __future__ import annotations

import argparse
import subprocess
import sys

from rolloutrun_runtime import cli


def test_help_lists_installed_commands():
    out = subprocess.run(
        [sys.executable, "-m", "rolloutrun_runtime.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for command in ("crd", "validate"):
        assert command in out


def test_no_command_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_commands_dispatch_to_their_handler():
    seen = {}

    def register(parser: argparse.ArgumentParser) -> None:
        """Echo a word."""
        parser.add_argument("word")
        parser.set_defaults(handler=lambda args: seen.setdefault("word", args.word) and 7)

    parser = cli.build_parser({"echo": register})
    args = parser.parse_args(["echo", "hi"])
    assert args.handler(args) == 7 and seen == {"word": "hi"}
    assert "Echo a word." in parser.format_help()


def test_a_command_that_cannot_import_explains_itself(capsys):
    register = cli._unavailable("gym", ImportError("No module named 'torch'"))
    parser = cli.build_parser({"gym": register})
    args = parser.parse_args(["gym"])
    assert args.handler(args) == 3
    assert "unavailable in this installation: No module named 'torch'" in capsys.readouterr().err
