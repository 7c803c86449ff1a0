"""The `fairq` command. Each subcommand lives with the code it drives and registers
itself here through an `add_parser(subparsers)` function."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, imported lazily so `fairq sim` never loads nats or redis.
COMMANDS = {
    "sim": "dispatcher.simulate",
    # One module, four commands (submit, status, cancel, top): `fairq status|cancel|top`
    # are found by building the full parser.
    "submit": "producers.commands",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fairq", description="Fair multi-tenant LLM inference dispatch over NATS.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module).add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=f"see `fairq {name} --help`")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
