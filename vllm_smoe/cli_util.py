"""What every smoe command does with a user mistake: one line on stderr, exit code 2."""

from __future__ import annotations

import argparse
import sys


def run_cli(parser: argparse.ArgumentParser, argv=None) -> int:
    """Parse ``argv`` and call the chosen subcommand's ``fn(args)``; a ValueError (bad input,
    named by the code that raised it) becomes ``error: ...`` and exit code 2, not a traceback."""
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
