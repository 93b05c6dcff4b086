"""``smoe-trace``: validate, inspect and recover routing traces (the format is
:mod:`vllm_smoe.formats.trace`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from ..formats.trace import find_spills, open_trace, recover_spill, spill_owner_alive, summary
from .cli_util import run_cli


def _recover_main(dirs: Sequence[str], force: bool) -> int:
    status = 0
    for d in dirs:
        if not os.path.isdir(d):
            print(f"error: {d}: not a directory", file=sys.stderr)
            return 2
        try:
            spills = find_spills(d)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not spills:
            print(f"{d}: nothing to recover")
        for sd in spills:
            if not force and spill_owner_alive(sd):
                print(f"skipped {sd}: its writer is still running (it holds the spill's lock) or it has no "
                      f"lock file (--force to recover anyway)")
                continue
            try:
                out, n = recover_spill(sd, force=force)
            except (ValueError, OSError) as e:  # named, and the next spill is still tried
                print(f"error: {e}", file=sys.stderr)
                status = 2
                continue
            print(f"recovered {out}: {n} tokens" if out else f"removed {sd}: no complete row")
    return status


def _files_main(args) -> int:
    for f in args.files:
        t = open_trace(f, validate=args.cmd == "validate")
        if args.cmd == "validate":
            print(f"ok: {f}: {t.num_tokens} tokens, {t.meta.num_layers} layers, "
                  f"{t.meta.num_experts} experts, top-{t.meta.top_k}")
        else:
            print(json.dumps(summary(t), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="smoe-trace",
        description="Validate, inspect and recover smoe routing traces (.npz). Also: python -m vllm_smoe.tools.trace_cli",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check every field and every row; exit 2 on the first problem")
    v.add_argument("files", nargs="+", help="trace .npz files")
    v.set_defaults(fn=_files_main)
    i = sub.add_parser("info", help="print meta, fields and token count (reads no rows)")
    i.add_argument("files", nargs="+")
    i.set_defaults(fn=_files_main)
    r = sub.add_parser("recover", help="turn the spill data a recorder left behind (killed before it closed "
                                       "its file) into traces")
    r.add_argument("dirs", nargs="+", help="record directories (their .trace-* spill directories are read)")
    r.add_argument("--force", action="store_true",
                   help="also spill directories still locked (a writer on another machine of a shared file "
                        "system, where locks may not be seen): only when no writer can be running")
    r.set_defaults(fn=lambda a: _recover_main(a.dirs, a.force))
    return run_cli(p, argv)


if __name__ == "__main__":
    sys.exit(main())
