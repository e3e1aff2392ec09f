"""The `distserve` command: one subcommand per module, registered in COMMANDS.

Each command module exposes `NAME`, `HELP`, `add_arguments(parser)` and `run(args) ->
int`. User mistakes (an invalid spec, an impossible placement) end with a message
on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from distserve.spec import SpecError

EXIT_SPEC_ERROR = 2
# One line per command; a module listed here that is not there yet is skipped.
COMMANDS = [
    "distserve.cli.plan",
    "distserve.cli.simulate",
    "distserve.cli.up",
    "distserve.cli.profile",
    "distserve.cli.fidelity",
    "distserve.cli.operator",
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="distserve", description="Goodput-optimised disaggregated LLM serving."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue
            raise
        command = sub.add_parser(module.NAME, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except SpecError as err:
        print(f"error: invalid spec: {err}", file=sys.stderr)
        return EXIT_SPEC_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
