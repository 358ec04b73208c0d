"""The parser class every subcommand uses (defaults in --help, a usage error as one line and a hint)
and the one way a failure is printed."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Optional


def report_error(prog: str, message: str, hint: Optional[str]) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, as in `vllm serve --help`; a None default (the help
    says what happens then) and a suppressed one are left out."""

    def _get_help_string(self, action):
        help = action.help or ""
        if "%(default)" in help or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return help
        return f"{help} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Subparsers inherit this class (argparse builds them with the parent's type), so every subcommand
    shows defaults and reports a usage error as one line plus a hint instead of the whole usage block."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        report_error(self.prog, message, f"'{self.prog} --help' lists the options")
        sys.exit(2)


def add_debug_arg(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: a subcommand's default must not overwrite a --debug given before the subcommand
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print the traceback of an error (default: off)")

