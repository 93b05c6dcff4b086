"""vLLM's model runners and workers, wrapped so smoe's per-step hooks run around served steps
(:mod:`vllm_smoe.serving.runner_hooks` holds the hooks and what a step looks like). vLLM has no
per-step plugin hook yet (see the entries in :data:`..PATCHES`)."""

from __future__ import annotations

from typing import Callable

from . import require


def wrap_runner(cls: type, patch_id: str, around: Callable) -> None:
    """``cls.execute_model(so, ...)`` becomes ``around(orig, runner, so, ...)`` (idempotent; an
    inherited wrapper counts)."""
    if getattr(cls.execute_model, "_smoe_wrapped", False):
        return
    orig = cls.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        return around(orig, self, scheduler_output, *args, **kwargs)

    execute_model._smoe_wrapped = True
    require(patch_id, cls, "execute_model", execute_model)


def wrap_worker(cls: type, patch_id: str, after: Callable[[], None]) -> None:
    """``after()`` once the worker's ``compile_or_warm_up_model`` returns (idempotent)."""
    if getattr(cls.compile_or_warm_up_model, "_smoe_wrapped", False):
        return
    orig = cls.compile_or_warm_up_model

    def compile_or_warm_up_model(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        after()
        return out

    compile_or_warm_up_model._smoe_wrapped = True
    require(patch_id, cls, "compile_or_warm_up_model", compile_or_warm_up_model)
