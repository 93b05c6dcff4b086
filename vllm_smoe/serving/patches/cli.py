"""``vllm serve``'s command, wrapped so a smoe settings error is one line and exit code 2 (see
:data:`..PATCHES`)."""

from __future__ import annotations

import sys

from . import replace


def install() -> None:
    """``vllm serve``: a smoe settings error is one line on stderr and exit code 2, not a
    traceback (vLLM's CLI has no hook for a plugin's refusal). Only where the CLI has already
    imported its serve command (never in workers); idempotent."""
    mod = sys.modules.get("vllm.entrypoints.cli.serve")
    cls = getattr(mod, "ServeSubcommand", None)
    if cls is None or cls.cmd is _serve_cmd:
        return
    _serve_cmd._smoe_original = cls.cmd
    replace("serve_cmd", cls, "cmd", staticmethod(_serve_cmd))


def _serve_cmd(args):
    """vLLM's ``serve`` command, exiting 2 with one line on a smoe settings error. Module-level:
    vLLM pickles the parsed arguments, this function among them, for its extra API servers."""
    from ..config import SmoeSettingsError

    orig = getattr(_serve_cmd, "_smoe_original", None)
    if orig is None:  # a process that unpickled the arguments without wrapping the command
        from vllm.entrypoints.cli.serve import ServeSubcommand

        orig = ServeSubcommand.cmd
    try:
        return orig(args)
    except SmoeSettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
