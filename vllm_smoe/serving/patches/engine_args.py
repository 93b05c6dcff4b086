"""Four of ``EngineArgs``' own steps, wrapped so smoe's flags, settings and checks run inside
them (:mod:`vllm_smoe.serving.plugin` holds what they do). vLLM has no plugin hook for CLI
arguments or for finishing an engine config (see :data:`..PATCHES`)."""

from __future__ import annotations

from typing import Callable

from . import require


def install(add_flags: Callable, fold: Callable, load_config: Callable, before: Callable, after: Callable) -> None:
    """``add_flags(parser)`` after ``add_cli_args``; ``fold(engine_args, args)`` returns what
    ``from_cli_args`` does; ``load_config(engine_args, load_config)`` the load config;
    ``before(engine_args)`` returns smoe's settings before ``create_engine_config`` and
    ``after(engine_args, cfg, vllm_config)`` checks what it built. Without these smoe has no
    flags and no checks, so each is required: a vLLM whose steps differ is named, not served."""
    from vllm.engine.arg_utils import EngineArgs

    for attr in ("add_cli_args", "from_cli_args", "create_load_config", "create_engine_config"):
        if not hasattr(EngineArgs, attr):
            raise RuntimeError(f"smoe: vLLM's EngineArgs has no {attr}(); this vLLM version is not supported "
                               f"by vllm-smoe (built for vLLM 0.32)")
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

    require("engine_args_add_cli_args", EngineArgs, "add_cli_args", staticmethod(add_cli_args))
    require("engine_args_from_cli_args", EngineArgs, "from_cli_args", classmethod(from_cli_args))
    require("engine_args_create_load_config", EngineArgs, "create_load_config", create_load_config)
    require("engine_args_create_engine_config", EngineArgs, "create_engine_config", create_engine_config)
