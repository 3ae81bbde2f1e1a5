"""argparse value types shared by the command-line entry points (one message format everywhere)."""

from __future__ import annotations

import argparse


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
