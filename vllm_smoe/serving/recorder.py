"""Record mode: live routing of every scheduled token, written as routing-trace chunks.

- Each MoE layer's router gets a capture callback (``router.set_capture_fn``, vLLM's own hook)
  that copies the step's top-k ids into a preallocated buffer in place, so it keeps working
  where the forward runs compiled or as a replayed graph.
- After each engine step (``execute_model`` of the model runner, wrapped only when recording)
  the buffer is drained together with the runner's token ids, positions and request order.
  Warm-up and profiling runs never pass through ``execute_model``, so they are never written.
- Physical slots are mapped back to logical expert ids when a placement is applied.
- Only tensor-parallel rank 0 writes (other TP ranks see the same tokens); each data-parallel
  rank writes its own files, ``trace-dp{rank}-{start time}-{pid}-{chunk:05d}.npz``, rotated every
  ``record_chunk_tokens`` tokens, and closed by a background thread once no step has come for
  ``IDLE_CLOSE_S`` seconds.
- Durability: every step's rows go to the writer's spill files with unbuffered writes, so once
  a step is appended it survives the process. A clean stop (Ctrl-C, SIGTERM, vLLM's shutdown of
  its engine and workers) closes the open file: vLLM's engine and workers are multiprocessing
  children, which skip ``atexit``, so the close is registered with ``multiprocessing.util.Finalize``
  as well. A hard kill leaves a spill directory; the next recorder start on the same directory
  (or ``smoe-trace recover DIR``) turns it into a trace, losing at most the step being written.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util
import os
import re
import threading
import time
from functools import partial

import numpy as np
import torch

from ..config import SmoeConfig
from ..model_info import moe_layer_indices, num_experts, top_k
from ..trace import TraceMeta, TraceWriter, recover_dead_spills

logger = logging.getLogger("vllm.smoe")
_ACTIVE: "Recorder | None" = None
_LAYER = re.compile(r"\.layers\.(\d+)\.")
IDLE_CLOSE_S = 2.0


class Recorder:
    def __init__(self, model: torch.nn.Module, vllm_config, cfg: SmoeConfig, plan):
        hf = vllm_config.model_config.hf_config
        self.cfg = cfg
        self.layers = moe_layer_indices(hf)
        self.E, self.K, self.L = num_experts(hf), top_k(hf), len(self.layers)
        self.slot2expert = None if plan is None else torch.as_tensor(plan.slot2expert)  # [L, E]
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        device = next(model.parameters()).device
        self.buf = torch.zeros((max_tokens, self.L, self.K), dtype=torch.int32, device=device)
        hooked = 0
        for name, module in model.named_modules():
            router = getattr(module, "router", None)
            if router is None or not hasattr(router, "set_capture_fn"):
                continue
            m = _LAYER.search("." + name + ".")
            if m is None or int(m.group(1)) not in self.layers:
                continue
            router.set_capture_fn(partial(self._capture, self.layers.index(int(m.group(1)))))
            hooked += 1
        if hooked != self.L:
            raise RuntimeError(f"smoe record: found {hooked} MoE routers, expected {self.L} MoE layers")
        pc = vllm_config.parallel_config
        from vllm.distributed import get_tensor_model_parallel_rank

        self.writes = get_tensor_model_parallel_rank() == 0
        self.dp_rank = pc.data_parallel_rank
        self.meta = TraceMeta(num_experts=self.E, top_k=self.K, num_layers=self.L, vocab_size=hf.vocab_size,
                              model=vllm_config.model_config.model, hidden_size=hf.hidden_size,
                              extra={"recorded_by": "vllm-smoe", "placement": cfg.placement,
                                     "recording": f"{os.uname().nodename}-{os.getpid()}-{time.time_ns()}"})
        self.started = time.strftime("%Y%m%dT%H%M%S")
        self.req_index: dict[str, int] = {}
        self.step = 0
        self.chunk = 0
        self.writer: TraceWriter | None = None
        self.total = 0
        self.last_log = time.monotonic()
        self.last_step = time.monotonic()
        self.lock = threading.Lock()
        if self.writes:
            os.makedirs(cfg.record, exist_ok=True)  # checked before serving, created once serving
            self._recover_leftovers()
        atexit.register(self.close)  # a main process (LLM offline, uniprocess)
        multiprocessing.util.Finalize(self, self.close, exitpriority=100)  # vLLM's engine / worker processes
        threading.Thread(target=self._close_when_idle, name="smoe-record", daemon=True).start()

    def _recover_leftovers(self) -> None:
        """Spill directories of recorders killed before closing their file (earlier runs)."""
        for spill, out, n, error in recover_dead_spills(self.cfg.record):
            if error:
                logger.warning("smoe record: %s", error)
            else:
                logger.info("smoe record: recovered %s from an earlier run: %d tokens", out or spill, n)

    def _close_writer(self) -> None:
        """Under self.lock. A failed close (disk full) must not stop serving: its spill data
        stays for recovery and the next step opens a new file."""
        writer, self.writer = self.writer, None
        try:
            path = writer.close()
        except (OSError, ValueError) as e:
            logger.error("smoe record: could not write %s (%s); its %d tokens stay in %s for smoe-trace recover",
                         writer.path, e, writer.num_tokens, os.path.dirname(writer.path))
            return
        logger.info("smoe record: wrote %s: %d tokens", path, writer.num_tokens)

    def _close_when_idle(self) -> None:
        while True:
            time.sleep(IDLE_CLOSE_S / 4)
            with self.lock:
                if self.writer is not None and time.monotonic() - self.last_step > IDLE_CLOSE_S:
                    self._close_writer()

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        n = topk_ids.shape[0]
        self.buf[:n, layer].copy_(topk_ids)

    def _open(self) -> TraceWriter:
        # the start time keeps names unique when a restarted container reuses the same pids
        path = os.path.join(self.cfg.record, f"trace-dp{self.dp_rank}-{self.started}-{os.getpid()}-{self.chunk:05d}.npz")
        self.chunk += 1
        return TraceWriter(path, self.meta)

    def after_step(self, runner, scheduler_output) -> None:
        n = int(scheduler_output.total_num_scheduled_tokens)
        if n == 0 or not self.writes:
            return
        req_ids = list(runner.input_batch.req_ids)
        counts = np.array([scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids], dtype=np.int64)
        if counts.sum() != n:
            logger.warning("smoe record: step %d skipped: %d tokens scheduled but %d in the batch", self.step, n,
                           counts.sum())
            return
        ids = runner.input_ids.gpu[:n].to("cpu").numpy().astype(np.int32)
        pos = runner.positions[:n].to("cpu").numpy().astype(np.int32)
        topk = self.buf[:n].to("cpu")
        if self.slot2expert is not None:  # physical slot -> logical expert, per layer
            topk = torch.stack([self.slot2expert[layer][topk[:, layer].long()] for layer in range(self.L)], dim=1)
        req = np.repeat([self.req_index.setdefault(r, len(self.req_index)) for r in req_ids], counts)
        prompt = np.repeat(np.asarray(runner.input_batch.num_prompt_tokens[: len(req_ids)]), counts)
        with self.lock:
            if self.writer is None:
                self.writer = self._open()
            self.writer.append(token_ids=ids, request_ids=req.astype(np.int32), positions=pos,
                               topk_ids=topk.numpy().astype(np.int16 if self.E < 32768 else np.int32),
                               step_ids=np.full(n, self.step, dtype=np.int32), is_prefill=pos < prompt)
            self.step += 1
            self.total += n
            self.last_step = time.monotonic()
            if self.writer.num_tokens >= self.cfg.record_chunk_tokens:
                self._close_writer()
        now = time.monotonic()
        if now - self.last_log >= self.cfg.log_interval:
            logger.info("smoe record: %d tokens in %d steps written to %s", self.total, self.step, self.cfg.record)
            self.last_log = now

    def swap(self, plan, path: str) -> None:
        """A live re-placement (:mod:`.live`): files written from now on map slots through the new
        placement and name it; the open file, written under the old one, is closed."""
        import dataclasses

        with self.lock:
            if self.writer is not None:
                self._close_writer()
            self.slot2expert = torch.as_tensor(plan.slot2expert)
            self.meta = dataclasses.replace(self.meta, extra={**self.meta.extra, "placement": path})

    def close(self) -> None:
        with self.lock:
            if self.writer is not None:
                self._close_writer()
                logger.info("smoe record: closed at shutdown; %d tokens in %d steps recorded to %s in all",
                            self.total, self.step, self.cfg.record)


def _wrap_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.execute_model, "_smoe_wrapped", False):
        return
    orig = GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        out = orig(self, scheduler_output, *args, **kwargs)
        if _ACTIVE is not None:
            _ACTIVE.after_step(self, scheduler_output)
        return out

    execute_model._smoe_wrapped = True
    GPUModelRunner.execute_model = execute_model


def install_recorder(model, vllm_config, cfg: SmoeConfig, plan) -> Recorder:
    """Hook the routers of ``model`` and the runner's step; called by the smoe loader."""
    global _ACTIVE
    _wrap_runner()
    _ACTIVE = Recorder(model, vllm_config, cfg, plan)
    logger.info("smoe record: capturing %d MoE layers into %s", _ACTIVE.L, cfg.record)
    return _ACTIVE

