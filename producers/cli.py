"""The `fairq` command. Each subcommand lives with the code it drives and registers
itself here through an `add_parser(subparsers)` function."""

from __future__ import annotations

import argparse
import importlib
import sys

# Command -> the module that registers it, imported lazily so that `fairq sim` never
# loads nats or redis. A module may register several commands.
COMMANDS = {
    "up": "producers.up",
    "sim": "producers.simulate",
    "submit": "producers.request_commands",
    "status": "producers.request_commands",
    "cancel": "producers.request_commands",
    "top": "producers.commands",
    "reload": "producers.commands",
    "calibrate": "workers.calibrate",
    "front-key": "producers.openai_front.keys",
    "auth": "producers.auth_command",
    "demo": "producers.demo",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that command's module is imported."""
    parser = argparse.ArgumentParser(
        prog="fairq", description="Fair multi-tenant LLM inference dispatch over NATS."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[only]] if only in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for module in modules:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
