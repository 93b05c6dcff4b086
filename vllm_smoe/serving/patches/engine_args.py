"""Four of ``EngineArgs``' own steps, wrapped so smoe's flags, settings and checks run inside
them (:mod:`vllm_smoe.serving.plugin` holds what they do). vLLM has no plugin hook for CLI
arguments or for finishing an engine config (see :data:`..PATCHES`)."""

from __future__ import annotations

import logging
from typing import Callable

from . import check, replace

logger = logging.getLogger("vllm.smoe")


def install(add_flags: Callable, fold: Callable, load_config: Callable, before: Callable, after: Callable) -> None:
    """``add_flags(parser)`` after ``add_cli_args``; ``fold(engine_args, args)`` returns what
    ``from_cli_args`` does; ``load_config(engine_args, load_config)`` the load config;
    ``before(engine_args)`` returns smoe's settings before ``create_engine_config`` and
    ``after(engine_args, cfg, vllm_config)`` checks what it built. Without these smoe has no
    flags and no checks: a vLLM whose steps differ gets none of them, and one error line naming
    each (vLLM itself keeps working)."""
    from vllm.engine.arg_utils import EngineArgs

    attrs = ("add_cli_args", "from_cli_args", "create_load_config", "create_engine_config")
    # all four or none, and never a failure: this runs in every vLLM process, smoe asked for or not
    bad = [line for attr in attrs if (line := check(f"engine_args_{attr}", EngineArgs, attr))]
    if bad:
        logger.error("smoe is off: this vLLM is not the one smoe was written for (%s); vllm serve does not "
                     "take --plugin smoe here", "; ".join(bad))
        return
    orig_add = EngineArgs.add_cli_args
    orig_from = EngineArgs.from_cli_args.__func__
    orig_load = EngineArgs.create_load_config
    orig_engine = EngineArgs.create_engine_config

    def add_cli_args(parser):
        parser = orig_add(parser)
        add_flags(parser)
        return parser

    def from_cli_args(cls, args):
        return fold(orig_from(cls, args), args)

    def create_load_config(self):
        return load_config(self, orig_load(self))

    def create_engine_config(self, *args, **kwargs):
        cfg = before(self)
        vllm_config = orig_engine(self, *args, **kwargs)
        after(self, cfg, vllm_config)
        return vllm_config

    new = {"add_cli_args": staticmethod(add_cli_args), "from_cli_args": classmethod(from_cli_args),
           "create_load_config": create_load_config, "create_engine_config": create_engine_config}
    for attr, fn in new.items():
        replace(f"engine_args_{attr}", EngineArgs, attr, fn)
