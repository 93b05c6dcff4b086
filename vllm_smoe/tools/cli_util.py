"""What every smoe command does with a user mistake: one line on stderr, exit code 2.

Also the argparse types that refuse non-finite or out-of-range numbers (argparse then names the
flag), the output checks every command runs before any work, and the heap setting of the
commands that churn large temporary arrays.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback

from ..formats.bounded import refuse_special


HEAP_TOP_PAD = 64 << 20
HEAP_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its adaptive threshold on 64-bit
_M_TOP_PAD, _M_MMAP_THRESHOLD = -2, -3  # glibc's mallopt parameters


def keep_heap() -> bool:
    """Ask glibc to serve arrays under HEAP_MMAP_THRESHOLD from the heap and to keep HEAP_TOP_PAD
    bytes of freed heap instead of handing it back to the kernel.

    The polish scores a placement with ~10 MB of temporary arrays each time; by default glibc
    returned them to the kernel after every score and took page faults to get them back: a fifth
    of a fixture build's CPU time (sys 5.3 s of 24 s at EP 8), 40% on a Mixtral-shaped trace
    (BENCHMARKS.md "Build time and the heap"). Setting the pad turns off glibc's adaptive mmap
    threshold, so the threshold is set too, to the most that adaptation would reach. For the whole
    process that calls it (smoe-place's ``main``, also when a benchmark or test calls that main),
    inherited by forked workers; a no-op (False) off glibc."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TOP_PAD, HEAP_TOP_PAD))
    except (ImportError, OSError, AttributeError):
        return False


def run_cli(parser: argparse.ArgumentParser, argv=None) -> int:
    """Parse ``argv`` and call the chosen subcommand's ``fn(args)``. Bad input (a ValueError,
    named by the code that raised it) and I/O failures (an OSError names its file) become
    ``error: ...`` and exit code 2, not a traceback; ``--debug`` shows the traceback too."""
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    for action in parser._actions:  # also after a subcommand (argparse keeps no public list of them)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="show the Python traceback of an error")
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as e:
        if args.debug:
            traceback.print_exc()
        if isinstance(e, OSError) and e.filename is not None:
            print(f"error: {e.filename}: {e.strerror or e}", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return 2


def number(kind=float, lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    """argparse type: a finite ``kind`` in [lo, hi] (or (lo, hi] with ``lo_open``)."""

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r} is not finite")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if lo_open else '>='} {lo}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"{text} must be <= {hi}")
        return v

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value" wording
    return parse


def _probe_dir(directory: str, path: str, flag: str) -> None:
    """Create ``directory`` (parents included) and a file in it, then remove all that was made:
    a real test (permissions, read-only or virtual file systems, root included), no debris."""
    import tempfile

    made = []
    d = os.path.abspath(directory)
    while not os.path.exists(d):
        made.append(d)
        d = os.path.dirname(d)
    if not os.path.isdir(d):
        raise ValueError(f"{path}: {flag}: {d} is a file, not a directory")
    created = []
    try:
        for m in reversed(made):
            try:
                os.mkdir(m)
                created.append(m)
            except FileExistsError:  # made meanwhile by someone else (a concurrent build): theirs
                if not os.path.isdir(m):
                    raise
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(f"{path}: {flag}: cannot write in {e.filename or directory} ({e.strerror})") from None
    finally:
        for m in reversed(created):
            try:
                os.rmdir(m)
            except OSError:
                pass  # not empty: someone else writes there now


def check_output_file(path: str, flag: str) -> None:
    """Before any work: ``path`` can be written as a file (parents created as needed)."""
    path = str(path)
    refuse_special(path, flag)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{path}: {flag}: not writable")
    _probe_dir(os.path.dirname(os.path.abspath(path)), path, flag)


def check_output_dir(path: str, flag: str) -> None:
    """Before any work: ``path`` is or can become a writable directory."""
    path = str(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{path}: {flag} names a file, not a directory")
    _probe_dir(path, path, flag)
