"""argparse pieces shared by the command-line entry points (`edgevlm`, `python -m` of a tool or
of the camera): value types with one message format everywhere, a parser whose errors are one
line, and the one-line error reporting of a command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


def _int(text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not an integer") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{value} must be >= {lowest}")
    return value


def positive_int(text: str) -> int:
    return _int(text, 1)


def non_negative_int(text: str) -> int:
    return _int(text, 0)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`prog: error: message`), not usage + message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace, prog: str = "edgevlm") -> int:
    """handler(args), with ValueError / OSError / RuntimeError as one line on stderr and exit 1
    (never a traceback), and Ctrl-C as 130."""
    try:
        return int(handler(args))
    except (ValueError, OSError, RuntimeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def command_main(prog: str, add_arguments: Callable[[argparse.ArgumentParser], argparse.ArgumentParser],
                 handler: Callable[[argparse.Namespace], int], argv: Sequence[str] | None = None) -> int:
    """The `python -m` entry point of one subcommand: the same arguments, errors and exit codes
    as `edgevlm <subcommand>`, without importing the CLI (which imports every subcommand)."""
    parser = add_arguments(OneLineParser(prog=prog))
    return run_command(handler, parser.parse_args(sys.argv[1:] if argv is None else argv))
