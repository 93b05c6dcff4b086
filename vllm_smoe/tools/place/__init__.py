"""``smoe-place``: learn route predictors and a balanced token-expert placement from routing
traces, write it as YAML, and compare it with the placements users run today.

The command line only: flags (``parser``), reading traces and checkpoints (``read``), running
the solvers (``solve``) and one module per subcommand (``build``, ``evaluate`` with ``report``,
``advise``; ``calibrate`` in ``..cluster_cost``). What they compute is ``vllm_smoe.placement``'s:
the rows streamed and spanned (``stream``, ``spans``), solved (``layout``, ``dp_build``), their
tables completed (``train``), measured (``measure``) and chosen among (``choose``).
"""

from __future__ import annotations

from ..cli_util import keep_heap, run_cli
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv=None) -> int:
    keep_heap()
    return run_cli(build_parser(), argv)
