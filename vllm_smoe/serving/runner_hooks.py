"""smoe's per-step hooks on vLLM's model runners, and what a step looks like on each of them.

vLLM 0.32 has two model runners: V1 (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, what
the CPU wheel builds: it has no Triton) and Model Runner V2 (``vllm.v1.worker.gpu.model_runner``,
the default on CUDA; not a V1 subclass). Their CPU runners subclass them. smoe wraps
``execute_model`` of both base classes once (:mod:`.patches.runners`, listed in
:data:`.patches.PATCHES`) and runs its hooks there, on the host, outside any CUDA graph
(the hooks: :func:`attach`).

Warm-up, profiling and graph capture never reach the hooks: V1 runs them through
``_dummy_run``, V2 passes ``dummy_run=True``, which the wrapper skips, and V2's kernel warm-up
runs inside the worker's ``compile_or_warm_up_model``: the hooks start only once that has
returned. Upstream: vLLM has no per-step plugin hook on its model runners; this wrapper goes away
once one exists. Checked at start: both classes must have ``execute_model`` (else smoe refuses)."""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .patches import runners

logger = logging.getLogger("vllm.smoe")

WORKERS = ("vllm.v1.worker.gpu_worker:Worker", "vllm.v1.worker.cpu_worker:CPUWorker")
V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
CPU_V1 = "vllm.v1.worker.cpu_model_runner:CPUModelRunner"
_PATCH_IDS = {V1: "runner_v1_execute_model", V2: "runner_v2_execute_model", WORKERS[0]: "gpu_worker_warm_up",
              WORKERS[1]: "cpu_worker_warm_up"}
CPU_V2 = "vllm.v1.worker.cpu.model_runner:CPUModelRunner"


@dataclass(frozen=True)
class Step:
    """One served step's batch, in the order of its rows. req_ids: vLLM's request ids;
    counts: [R] int64 rows of each request (sum = n); input_ids: [n] int device tensor, None
    for rows given as embeddings; positions: [n] int64 device tensor."""

    req_ids: list[str]
    counts: np.ndarray
    input_ids: torch.Tensor | None
    positions: torch.Tensor


def _load(path: str) -> type:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def runner_class_for(vllm_config, device_type: str) -> str:
    """The runner class vLLM's worker builds for this config (``gpu_worker._make_model_runner``,
    ``cpu_worker``): V2 when ``vllm_config.use_v2_model_runner``."""
    v2 = bool(vllm_config.use_v2_model_runner)
    if device_type == "cpu":
        return CPU_V2 if v2 else CPU_V1
    return V2 if v2 else V1


def attached_to(path: str) -> bool:
    """Does smoe's wrapper run for ``path``'s ``execute_model`` (its own or inherited)?"""
    return bool(getattr(getattr(_load(path), "execute_model", None), "_smoe_wrapped", False))


def step_of(runner, scheduler_output) -> Step | None:
    """The step just run, from whichever runner ran it."""
    n = int(scheduler_output.total_num_scheduled_tokens)
    if n == 0:
        return None
    state = getattr(runner, "execute_model_state", None)
    if hasattr(runner, "input_buffers"):  # Model Runner V2: the batch is per step
        if state is None:
            return None  # no forward ran
        batch = state.input_batch
        req_ids = list(batch.req_ids)
        counts = np.asarray(batch.num_scheduled_tokens[: len(req_ids)], dtype=np.int64)
        # V2 always fills input_ids; with prompt embeddings allowed a row may not be a token
        embeds = getattr(getattr(runner, "model_config", None), "enable_prompt_embeds", False)
        ids = None if embeds or batch.input_ids is None else batch.input_ids[:n]
        return Step(req_ids, counts, ids, batch.positions[:n])
    batch = runner.input_batch  # V1: persistent batch, buffers on the runner
    req_ids = list(batch.req_ids)
    counts = np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids], dtype=np.int64)
    # with prompt embeddings allowed, a row's id may not be a token (the row came as a vector)
    ids = None if getattr(runner, "enable_prompt_embeds", False) else runner.input_ids.gpu[:n]
    return Step(req_ids, counts, ids, runner.positions[:n])


_BEFORE: list[Callable] = []
_AFTER: list[Callable] = []
_SERVING = [False]  # this process's worker finished compile_or_warm_up_model
# [served steps run, time.monotonic() when the last ended, one is running now]: host values the
# idle readers of device counters (observe/counters.py) go by
_ACTIVITY = [0, 0.0, False]


def serving() -> bool:
    return _SERVING[0]


def activity() -> tuple[int, float, bool]:
    """(served steps so far, monotonic time the last one ended, is one running now)."""
    return _ACTIVITY[0], _ACTIVITY[1], _ACTIVITY[2]


def _served(orig, runner, scheduler_output, *args, **kwargs):
    """One ``execute_model`` of a runner: smoe's hooks around it when it is a served step.

    V1's warm-up never calls ``execute_model`` (it runs ``_dummy_run``); V2's kernel warm-up sends
    made-up requests through it inside the worker's ``compile_or_warm_up_model``, so steps count as
    served only once that has returned (the same wrapper on vLLM's GPU and CPU workers)."""
    if kwargs.get("dummy_run") or not _SERVING[0]:
        return orig(runner, scheduler_output, *args, **kwargs)
    _ACTIVITY[2] = True
    try:
        for hook in _BEFORE:
            hook(runner, scheduler_output)
        out = orig(runner, scheduler_output, *args, **kwargs)
        if _AFTER:
            step = step_of(runner, scheduler_output)
            for hook in _AFTER:
                hook(runner, scheduler_output, step)
    finally:
        _ACTIVITY[0] += 1
        _ACTIVITY[1] = time.monotonic()
        _ACTIVITY[2] = False
    return out


def _warmed_up() -> None:
    _SERVING[0] = True  # from here on every execute_model is a served step


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def attach(before: Callable | None = None, after: Callable | None = None) -> None:
    """Run ``before``/``after`` around every served step of either runner (idempotent per
    callable). Raises RuntimeError naming the class when vLLM's runners changed shape.

    - ``before(runner, scheduler_output)``: a served step is about to run its forward (device-side
      state for it is written here: a graph replay reads it, a Python hook inside the forward would
      have been frozen at capture);
    - ``after(runner, scheduler_output, step)``: it ran; ``step`` is a :class:`Step` view of its
      batch, or None when the runner built none (nothing scheduled, a non-last pipeline rank)."""
    for path in (V1, V2):
        try:
            cls = _load(path)
        except ImportError as e:  # V2 imports only where its modules do (it needs no GPU to import)
            logger.debug("smoe: %s not importable (%s); its steps are not hooked", path, e)
            continue
        if not callable(getattr(cls, "execute_model", None)):
            raise RuntimeError(f"smoe: {path} has no execute_model(); this vLLM is not supported (built for 0.32)")
        runners.wrap_runner(cls, _PATCH_IDS[_path(cls)], _served)
    from vllm.platforms import current_platform

    # only this platform's worker: importing vLLM's CPU worker replaces parts of torch (its
    # events, pinned memory, streams) for the whole process
    for path in WORKERS[1:] if current_platform.is_cpu() else WORKERS[:1]:
        try:
            cls = _load(path)
        except ImportError as e:
            logger.debug("smoe: %s not importable (%s)", path, e)
            continue
        if not callable(getattr(cls, "compile_or_warm_up_model", None)):
            raise RuntimeError(f"smoe: {path} has no compile_or_warm_up_model(); this vLLM is not supported "
                               f"(built for 0.32)")
        runners.wrap_worker(cls, _PATCH_IDS[_path(cls)], _warmed_up)
    if before is not None and before not in _BEFORE:
        _BEFORE.append(before)
    if after is not None and after not in _AFTER:
        _AFTER.append(after)


def detach(*hooks: Callable) -> None:
    """Stop calling these hooks (a component that is replaced, tests)."""
    for hook in hooks:
        for registry in (_BEFORE, _AFTER):
            while hook in registry:
                registry.remove(hook)


def check_attached(vllm_config, device_type: str) -> None:
    """Refuse to serve when the runner vLLM will build is not hooked (never record silently
    nothing). Raises ValueError naming the class."""
    path = runner_class_for(vllm_config, device_type)
    try:
        ok = attached_to(path)
    except ImportError as e:
        raise ValueError(f"smoe: vLLM would build model runner {path}, which does not import here ({e})") from e
    if not ok:
        raise ValueError(f"smoe: vLLM would build model runner {path}, whose execute_model smoe could not hook; "
                         f"recording and speculate's counters need it")
