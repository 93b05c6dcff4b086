"""Recording: live routing of the scheduled tokens, written as routing-trace chunks, in any mode
(``record`` with or without a placement, ``speculate``).

Each MoE layer's router copies the step's top-k ids into a preallocated buffer (vLLM's capture
hook, so it works compiled and in replayed graphs; this DP rank's rows only, :mod:`.rows`);
after each engine step (:mod:`..runner_hooks`) the rows are copied off the device without
waiting and a writer thread appends them to trace files, so the step never waits for the disk.
Sampling, the disk budget, speculative decoding, rotation, the counters and durability:
:class:`Recorder`."""

from __future__ import annotations

import atexit
import glob
import logging
import multiprocessing.util
import os
import queue
import threading
import time
import zlib
from functools import partial

import numpy as np
import torch

from ..config import SmoeConfig
from .draft_rows import DraftRows, draft_counts
from .rows import StepRows
from ...formats.model_info import moe_layer_indices, num_experts, top_k
from ...formats.trace import TraceMeta, TraceWriter, recover_dead_spills

logger = logging.getLogger("vllm.smoe")
IDLE_CLOSE_S = 2.0
QUEUE_STEPS = 64  # steps waiting for the writer thread before new ones are dropped
MAX_FILE_SWAPS = 64  # live swaps one file's meta lists before the file is closed (bounds its meta)


def sampled(request_id: str, share: float) -> bool:
    """Is this request recorded? The same answer for every step of it, on every rank (crc32 of
    vLLM's request id, which carries a random suffix: another run picks other requests)."""
    return share >= 1.0 or zlib.crc32(request_id.encode()) < share * 2**32


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy the next step cannot overwrite, started without waiting for the device."""
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


class Recorder:
    """One worker's recorder: the routers' capture, the step's rows handed to a writer thread, the files.

    - Each MoE layer's router gets a capture callback (``router.set_capture_fn``, vLLM's own hook,
      chained after the token order's when speculating) that copies the step's top-k ids into a
      preallocated buffer in place, so it keeps working where the forward runs compiled or as a
      replayed graph. Only this DP rank's rows of the step are kept, in the step's order, whatever
      vLLM's layout (:mod:`.rows`): every DP rank's rows under naive dispatch, each TP rank's
      chunk under vLLM's sequence-parallel MoE (all-gathered on the TP group), speculate's chunks of
      reordered rows (``TokenOrder.gather_rows``). A step some layer did not write (a layout that
      fits no rule, a micro-batched step) is dropped whole and counted, never written from stale rows.
    - After each engine step (``execute_model`` of either model runner, V1 or V2, through
      :mod:`..runner_hooks`) the step's buffers are copied off the device without waiting for it
      (pinned memory and an event on GPU) and handed to a writer thread through a bounded queue;
      the step never waits for the disk. A full queue drops the step and counts it (logged). Warm-up and profiling
      runs never pass through ``execute_model``, so they are never written.
    - Sampling (``record_sample``): whole requests, kept when a stable hash of the request id falls
      under the share, so a kept request's every step is written.
    - Disk budget (``record_max_mb``): whenever a file is closed, the directory's oldest trace files
      are removed until the closed ones fit (the open chunk adds at most ``record_chunk_tokens``).
    - Physical slots are mapped back to logical expert ids when a placement is applied.
    - Speculative decoding: a draft token's row is written once its request's next step shows that
      sampling kept it (:mod:`.draft_rows`; where that step is dropped the row is left out, counted);
      a draft model's own routing is never recorded (the loader leaves it to vLLM, :mod:`..place.draft`).
      A vLLM whose scheduler output has no ``scheduled_spec_decode_tokens`` gets no step written
      while speculating (which rows are drafts is unknown; logged once, counted).
    - Only tensor-parallel rank 0 writes (other TP ranks see the same tokens); each data-parallel
      rank writes its own files, ``trace-dp{rank}-{start time}-{pid}-{chunk:05d}.npz``, rotated every
      ``record_chunk_tokens`` tokens, and closed by a background thread once no step has come for
      ``IDLE_CLOSE_S`` seconds; the same thread publishes the counters for ``/metrics`` whenever they
      changed and logs them (:meth:`Recorder._tick`), so they are current while idle too. A live swap
      keeps the open file (rows are logical experts; its meta lists the swaps).
    - Durability: every step's rows go to the writer's spill files with unbuffered writes, so once a
      step is appended (by the writer thread, right after the step) it survives the process. A clean
      stop (Ctrl-C, SIGTERM, vLLM's shutdown of its engine and workers) closes the open file: vLLM's
      engine and workers are multiprocessing children, which skip ``atexit``, so the close is
      registered with ``multiprocessing.util.Finalize`` as well. A hard kill leaves a spill
      directory; the next recorder start on the same directory (or ``smoe-trace recover DIR``) turns
      it into a trace, losing at most the steps still queued."""

    def __init__(self, model: torch.nn.Module, vllm_config, cfg: SmoeConfig, location=None, order=None):
        hf = vllm_config.model_config.hf_text_config  # a vision-language model's language model
        self.cfg = cfg
        self.layers = moe_layer_indices(hf)
        self.E, self.K, self.L = num_experts(hf), top_k(hf), len(self.layers)
        self.location = location  # DeviceLocation (a placement served): its slot map, None = slots are experts
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        device = next(model.parameters()).device
        pc = vllm_config.parallel_config
        pcp = getattr(pc, "prefill_context_parallel_size", 1)
        if pcp > 1:  # its MoE rows are split and gathered over the PCP group too: no layout rule covers them
            raise ValueError(f"smoe record: prefill_context_parallel_size {pcp} is not supported; record with "
                             f"--prefill-context-parallel-size 1")
        from vllm.distributed import get_tensor_model_parallel_rank

        self.writes = get_tensor_model_parallel_rank() == 0
        self.dp_rank = pc.data_parallel_rank
        self.rows = StepRows(max_tokens, self.L, self.K, device, int(self.dp_rank or 0), pc.tensor_parallel_size,
                             keep=self.writes)
        self.buf = self.rows.buf
        self.order = order  # speculate's TokenOrder: each rank's router sees its chunk of reordered rows
        from .capture import current_capture, set_capture
        from ..speculate.seams import find_moe_experts, hookable_gate

        found = find_moe_experts(model, tuple(self.layers))
        if len(found) != self.L:
            raise RuntimeError(f"smoe record: found {len(found)} MoE routers, expected {self.L} MoE layers")
        for layer, block, experts in found:
            prev = current_capture(experts)  # the token order's, when speculating
            gate = hookable_gate(block, experts, vllm_config)  # routes a monolithic kernel's rows again
            set_capture(experts, partial(self._capture, layer, prev),
                        f"smoe record: MoE layer {layer} ({type(block).__name__})", gate)
        meta = TraceMeta(num_experts=self.E, top_k=self.K, num_layers=self.L, vocab_size=hf.vocab_size,
                         model=vllm_config.model_config.model, hidden_size=hf.hidden_size,
                         extra={"recorded_by": "vllm-smoe", "placement": cfg.placement,
                                "recording": f"{os.uname().nodename}-{os.getpid()}-{time.time_ns()}",
                                "dp_rank": int(self.dp_rank or 0),
                                # how speculate ordered the rows: advise keeps rank names agreeing
                                # across layers for a server ordering once per step
                                **({} if order is None else {"token_order": order.rows_ordered})})
        from ..observe.metrics import metrics_dir

        self.speculative = getattr(vllm_config, "speculative_config", None) is not None
        self._host_state(cfg, meta, int(self.dp_rank or 0), metrics_dir(cfg) if self.writes else None)
        if self.writes:
            os.makedirs(cfg.record, exist_ok=True)  # checked before serving, created once serving
            self._recover_leftovers()
        atexit.register(self.close)  # a main process (LLM offline, uniprocess)
        multiprocessing.util.Finalize(self, self.close, exitpriority=100)  # vLLM's engine / worker processes
        if self.writes:  # another TP rank never opens a file nor counts a token
            threading.Thread(target=self._close_when_idle, name="smoe-record", daemon=True).start()
            threading.Thread(target=self._write_loop, name="smoe-record-writer", daemon=True).start()
            self._check_budget()

    def _host_state(self, cfg: SmoeConfig, meta: TraceMeta, dp_rank: int, metrics_dir: str | None) -> None:
        """The files' side of a recorder (no model, no threads: what the writer thread and the
        idle thread work on). meta: the trace meta of files opened from now on."""
        self.cfg, self.meta, self.dp_rank, self.metrics_dir = cfg, meta, dp_rank, metrics_dir
        self.started = time.strftime("%Y%m%dT%H%M%S")
        self.req_index: dict[str, int] = {}  # vLLM request id -> trace request id, while it runs
        self.prompt_len: dict[str, int] = {}  # vLLM request id -> prompt tokens, while it runs
        self.warned_skip = False
        self.warned_drafts = False
        self.unrecordable = 0  # tokens of steps that could not be recorded (no token ids, drafts unknown)
        self.unrouted = 0  # tokens of steps dropped because some layer wrote no rows for them (record_rows)
        self.next_req = 0
        self.step = 0
        self.chunk = 0
        self.writer: TraceWriter | None = None
        self.total = 0
        self.dropped = 0  # tokens of steps dropped because the writer fell behind
        self.skipped = 0  # tokens of requests left out by sampling
        self.drafts = DraftRows()  # speculative decoding: a draft's row waits for its request's next step
        self.removed = 0  # files removed for the disk budget
        self.failed = 0  # tokens lost to failed writes (a full disk, a removed directory), whole steps
        self.failing: str | None = None  # the failure writes currently meet (logged once), None = none
        self.stopped = False  # recording gave up (a directory it cannot write)
        self.file_meta: TraceMeta | None = None  # the open file's meta as opened (its placement then)
        self.file_swaps: list[list] = []  # the open file's live swaps: [first step id under it, placement path]
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_STEPS)
        self.last_log = time.monotonic()
        self.last_step = time.monotonic()
        self.reported: tuple | None = None  # the counters last published (None: none yet)
        self.logged = self.counters()  # the counters the last log line gave (none at start: nothing to say)
        self.lock = threading.Lock()

    def _check_budget(self) -> None:
        mb = self.cfg.record_max_mb
        if mb is None:
            return
        per_file = self.cfg.record_chunk_tokens * (self.L * self.K * 2 + 14) / 2**20  # uncompressed bound
        if per_file * 2 > mb:
            logger.warning("smoe record: files rotate every %d tokens (up to %.1f MiB each), so fewer than two fit "
                           "in record_max_mb %.1f: lower record_chunk_tokens", self.cfg.record_chunk_tokens,
                           per_file, mb)

    def _enforce_budget(self, keep: str | None = None) -> None:
        """Under self.lock, after a file is closed: oldest trace files out until the rest fit;
        ``keep`` (the file just closed) stays even when it alone exceeds the budget."""
        if self.cfg.record_max_mb is None:
            return
        limit = self.cfg.record_max_mb * 2**20
        files = []
        for f in glob.glob(os.path.join(self.cfg.record, "trace-*.npz")):
            try:
                st = os.stat(f)
            except FileNotFoundError:  # another DP rank's recorder removed it
                continue
            files.append((st.st_mtime, f, st.st_size))
        files.sort()
        total = sum(size for _, _, size in files)
        for _, f, size in files:
            if total <= limit:
                break
            if keep is not None and os.path.abspath(f) == os.path.abspath(keep):
                continue
            total -= size
            try:
                os.remove(f)
            except FileNotFoundError:
                continue  # removed by another DP rank's recorder sharing the directory: the goal either way
            self.removed += 1
            logger.info("smoe record: removed %s (%.1f MiB) to keep %s under record_max_mb %.1f", f, size / 2**20,
                        self.cfg.record, self.cfg.record_max_mb)

    def _recover_leftovers(self) -> None:
        """Spill directories of recorders killed before closing their file (earlier runs)."""
        for spill, out, n, error in recover_dead_spills(self.cfg.record):
            if error:
                logger.warning("smoe record: %s", error)
            else:
                logger.info("smoe record: recovered %s from an earlier run: %d tokens", out or spill, n)

    def _lost_writer(self) -> None:
        """Under self.lock: the open file's spill directory is gone (someone removed the record
        directory, or the spill in it): its rows are lost, counted, and said so once; the next
        step opens a new file (making the directory again)."""
        writer, self.writer = self.writer, None
        self.failed += writer.num_tokens
        writer.abort()
        logger.error("smoe record: the spill of %s (%s) was removed; its %d tokens are lost (counted in "
                     "smoe:record_lost_tokens{reason=\"failed\"}); recording goes on in a new file", writer.path,
                     writer.spill_dir, writer.num_tokens)

    def _close_writer(self) -> None:
        """Under self.lock. A failed close (disk full) must not stop serving: its spill data
        stays for recovery and the next step opens a new file."""
        if self.writer.num_tokens and not os.path.isdir(self.writer.spill_dir):
            self._lost_writer()
            return
        writer, self.writer = self.writer, None
        if writer.num_tokens == 0:  # every step it was given failed: nothing to keep, no file
            writer.abort()
            return
        try:
            path = writer.close()
        except (OSError, ValueError) as e:
            if not os.path.isdir(writer.spill_dir):  # removed during the close: no spill to point to
                self.failed += writer.num_tokens
                logger.error("smoe record: could not write %s (%s) and its spill is gone: its %d tokens are lost "
                             "(counted in smoe:record_lost_tokens{reason=\"failed\"})", writer.path, e,
                             writer.num_tokens)
                return
            logger.error("smoe record: could not write %s (%s); its %d tokens stay in %s for smoe-trace recover",
                         writer.path, e, writer.num_tokens, os.path.dirname(writer.path))
            return
        logger.info("smoe record: wrote %s: %d tokens", path, writer.num_tokens)
        self._enforce_budget(path)

    def _close_when_idle(self) -> None:
        while True:
            time.sleep(IDLE_CLOSE_S / 4)
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - logged; the thread must outlive one failed publish
                logger.exception("smoe record: idle check failed")

    def _tick(self) -> None:
        """The idle thread, every IDLE_CLOSE_S / 4 s: closes the file once no step has come for
        IDLE_CLOSE_S, publishes the counters whenever they changed (so /metrics is never more than
        a tick behind the writer, idle or not; nothing on the step's path), and logs them at most
        once per log interval, once more after the last change."""
        now = time.monotonic()
        with self.lock:
            if self.writer is not None and now - self.last_step > IDLE_CLOSE_S:
                self._close_writer()
            counts = self.counters()
        if counts != self.reported:
            self._publish(counts)
            self.reported = counts
        if counts != self.logged and now - self.last_log >= self.cfg.log_interval:
            self._log()
            self.logged, self.last_log = counts, now

    def counters(self) -> tuple:
        """(written, behind, failed, unrecordable) tokens so far: metrics.RECORD_FIELDS."""
        return self.total, self.dropped, self.failed, self.unrecordable + self.unrouted

    def _capture(self, layer: int, prev, topk_ids: torch.Tensor) -> None:
        if prev is not None:
            prev(topk_ids)
        self.rows.capture(layer, topk_ids, self.order)

    def _open(self) -> TraceWriter:
        # the start time keeps names unique when a restarted container reuses the same pids
        path = os.path.join(self.cfg.record, f"trace-dp{self.dp_rank}-{self.started}-{os.getpid()}-{self.chunk:05d}.npz")
        self.chunk += 1
        self.file_meta, self.file_swaps = self.meta, []
        return TraceWriter(path, self.meta)

    def after_step(self, runner, scheduler_output, step) -> None:
        """On the step's thread (:mod:`.runner_hooks`, either model runner): copies off the
        device, queued for the writer; no waiting. step: the step's :class:`~.runner_hooks.Step`."""
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            ids, embeds = getattr(new, "prompt_token_ids", None), getattr(new, "prompt_embeds", None)
            self.prompt_len[new.req_id] = len(ids) if ids is not None else (0 if embeds is None else len(embeds))
        for r in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.drafts.finished(self.req_index.pop(r, None))  # ids stay unique: the counter never goes back
            self.prompt_len.pop(r, None)
        n = int(scheduler_output.total_num_scheduled_tokens)
        if n == 0 or not self.writes or step is None:
            return
        req_ids, counts = step.req_ids, step.counts
        step_id = self.step
        self.step += 1
        drafts = draft_counts(scheduler_output, req_ids, self.speculative)
        if drafts is None and not self.warned_drafts:
            logger.error("smoe record: speculative decoding is on but this vLLM's scheduler output has no "
                         "scheduled_spec_decode_tokens, so which rows are drafts is unknown: no step is recorded "
                         "(counted in smoe:record_lost_tokens; logged once)")
            self.warned_drafts = True
        if counts.sum() != n or step.input_ids is None or drafts is None:
            if drafts is not None and not self.warned_skip:
                logger.warning("smoe record: step %d not recorded: %s (warned once)", step_id,
                               "rows came as embeddings, without token ids" if step.input_ids is None else
                               f"{n} tokens scheduled but {counts.sum()} in the batch")
                self.warned_skip = True
            self.unrecordable += n
            # the requests' held drafts: this was their next step, and it is not written
            self.drafts.drop(step_id, np.array([self.req_index.get(r, -1) for r in req_ids], dtype=np.int64))
            return
        keep = np.array([sampled(r, self.cfg.record_sample) for r in req_ids], dtype=bool)
        self.skipped += int(counts[~keep].sum())
        if keep.any():
            ev = None
            ids, pos, topk, written = (_host_copy(t) for t in (step.input_ids, step.positions, self.buf[:n],
                                                               self.rows.written))
            if ids.is_pinned():
                ev = torch.cuda.Event()
                ev.record()
            req = np.array([self._req_id(r) if k else -1 for r, k in zip(req_ids, keep)], dtype=np.int32)
            # a request never seen as new (started before the recorder): every row taken as decode
            prompt = np.array([self.prompt_len.get(r, 0) for r in req_ids], dtype=np.int64)
            # noted for every queued step: one the writer drops (queue full, rows not routed) it never settles
            self.drafts.note(step_id, drafts, req)
            try:
                self.queue.put_nowait(("step", ids, pos, topk, written, ev, req, counts, keep, prompt, step_id,
                                       self.slot_map()))
            except queue.Full:
                self.dropped += int(counts[keep].sum())

    def _log(self) -> None:
        """The recorder's log line: the numbers smoe:record_tokens and smoe:record_lost_tokens give."""
        extra = [f"{v} {what}" for v, what in ((self.skipped, "tokens not sampled"),
                                               (self.dropped, "tokens dropped (writer behind)"),
                                               (self.failed, "tokens dropped (writes failed)"),
                                               (self.unrecordable + self.unrouted, "tokens not recordable"),
                                               (self.removed, "files removed for the disk budget")) if v]
        logger.info("smoe record: %d tokens in %d steps written to %s%s", self.total, self.step,
                    self.cfg.record, "".join(", " + e for e in extra))

    def _publish(self, counts: tuple) -> None:
        """The recorder's counters for /metrics (host ints; per DP rank, where one rank writes)."""
        if self.metrics_dir is None:
            return
        from ..observe.metrics import RECORD_FIELDS, publish

        try:
            publish(self.metrics_dir, "record", self.dp_rank, dict(zip(RECORD_FIELDS, counts)))
        except OSError as e:
            logger.warning("smoe: record metrics not published any more: %s", e)
            self.metrics_dir = None

    def _req_id(self, request_id: str) -> int:
        i = self.req_index.get(request_id)
        if i is None:
            i = self.req_index[request_id] = self.next_req
            self.next_req += 1
        return i

    def _write_loop(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item[0] == "swap":
                    self._swapped(*item[1:])
                else:
                    self._write(*item[1:])
            except Exception:  # noqa: BLE001 - logged; the thread must outlive one bad step or a full disk
                logger.exception("smoe record: %s not written", f"step {item[10]}" if item[0] == "step" else "swap")
            finally:
                self.queue.task_done()

    def _write(self, ids, pos, topk, written, ev, req, counts, keep, prompt, step, slot2expert) -> None:
        if ev is not None:
            ev.synchronize()
        if not StepRows.complete(written, int(counts.sum())):  # some layer's rows are not this step's
            with self.lock:
                if not self.unrouted:
                    logger.warning("smoe record: step %d dropped: MoE layers %s wrote rows %s of its %d (counted in "
                                   "smoe:record_lost_tokens; warned once)", step,
                                   [self.layers[i] for i in range(self.L) if written[i] < counts.sum()],
                                   written.tolist(), int(counts.sum()))
                self.unrouted += int(counts[keep].sum())
            return
        if slot2expert is not None:  # physical slot -> logical expert, per layer
            topk = torch.stack([slot2expert[layer][topk[:, layer].long()] for layer in range(self.L)], dim=1)
        rows = np.repeat(keep, counts)
        pos = pos.numpy().astype(np.int32)[rows]
        is_prefill = pos < np.repeat(prompt, counts)[rows]
        fields = self.drafts.settle(step, {
            "token_ids": ids.numpy().astype(np.int32)[rows], "request_ids": np.repeat(req, counts)[rows],
            "positions": pos, "topk_ids": topk.numpy().astype(np.int16 if self.E < 32768 else np.int32)[rows],
            "step_ids": np.full(int(rows.sum()), step, dtype=np.int32), "is_prefill": is_prefill}, counts, rows)
        n = len(fields["token_ids"])
        with self.lock:
            if self.stopped:
                self.failed += n
                return
            if self.writer is not None and not os.path.isdir(self.writer.spill_dir):
                self._lost_writer()
            try:
                if self.writer is None:
                    if not os.path.isdir(self.cfg.record):  # removed while serving: made again once
                        os.makedirs(self.cfg.record, exist_ok=True)
                        logger.warning("smoe record: %s was removed; made it again and recording on", self.cfg.record)
                    self.writer = self._open()
                self.writer.append(**fields)
            except OSError as e:
                self._write_failed(e, n)
                return
            if self.failing:
                logger.info("smoe record: writing again, to %s; %d tokens were dropped while writes failed",
                            self.cfg.record, self.failed)
                self.failing = None
            self.total += n
            self.last_step = time.monotonic()
            if self.writer.num_tokens >= self.cfg.record_chunk_tokens:
                self._close_writer()

    def _write_failed(self, e: OSError, n: int) -> None:
        """Under self.lock: a step's rows could not be written; the step is dropped whole (the
        writer undid its part, so the file's rows stay aligned) and counted. A full disk is
        retried with every step (recording resumes when space returns); a directory removed
        under the writer loses the open file's rows and is made again with the next step;
        anything else (read-only, no permission, I/O error) stops recording with one error,
        leaving the open file's rows for ``smoe-trace recover``. One log line per failure kind."""
        import errno

        self.failed += n
        kind = os.strerror(e.errno) if e.errno else type(e).__name__
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            if self.failing != kind:
                logger.error("smoe record: cannot write to %s (%s); dropping whole steps until it can (counted "
                             "in smoe:record_lost_tokens)", self.cfg.record, kind)
            self.failing = kind
            return
        if self.writer is not None and (e.errno == errno.ENOENT or not os.path.isdir(self.cfg.record)):
            writer, self.writer = self.writer, None
            self.failed += writer.num_tokens  # gone with the directory
            writer.abort()
            if self.failing != kind:
                logger.error("smoe record: %s was removed while writing %s; its %d tokens are lost, and the next "
                             "step makes the directory again", self.cfg.record, writer.path, writer.num_tokens)
            self.failing = kind
            return
        self.stopped = True
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.release()
        logger.error("smoe record: stopped: cannot write to %s (%s); serving goes on without recording (restart "
                     "to record again; smoe-trace recover %s keeps what was written)", self.cfg.record, kind,
                     self.cfg.record)

    def _swapped(self, path: str, step: int) -> None:
        """Writer thread, in step order: steps from ``step`` on were served under ``path``. The
        open file goes on (its rows are logical experts whatever the placement: nothing in them
        changes at a swap); its meta lists the swap (``swaps``: [first step id, placement] pairs,
        ``placement`` staying the one it opened under), up to MAX_FILE_SWAPS, after which the
        file is closed. Files opened from now on name ``path`` as their placement."""
        import dataclasses

        with self.lock:
            if self.writer is not None and len(self.file_swaps) >= MAX_FILE_SWAPS:
                self._close_writer()
            if self.writer is not None:
                self.file_swaps.append([int(step), path])
                m = self.file_meta
                self.writer.meta = dataclasses.replace(m, extra={**m.extra, "swaps": list(self.file_swaps)})
            self.meta = dataclasses.replace(self.meta, extra={**self.meta.extra, "placement": path})

    def drain(self, timeout: float = 10.0) -> None:
        """Wait for the writer thread to take every queued step (at shutdown)."""
        end = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.005)

    def slot_map(self) -> torch.Tensor | None:
        """[L, E] int64 on the host, physical slot -> logical expert as served now (the device
        location's; a swap replaces it, so a queued step keeps the map it was served with), None
        without a placement (slots are experts)."""
        return None if self.location is None else self.location.host_slot2expert

    def swap(self, path: str) -> None:
        """A live re-placement (:mod:`.live`), between two steps, once the device location holds
        it: steps from now on map slots through the new placement (each queued step carries the
        map it was served with), and the writer thread, once the steps before are written, lists
        the swap in the open file's meta (:meth:`_swapped`)."""
        if self.writes:
            self.queue.put(("swap", path, self.step))  # waits only if 64 steps are queued

    def before_step(self, runner, scheduler_output) -> None:
        """Before each served step's forward: no layer has written its rows yet."""
        if self.writes:
            self.rows.begin_step()

    def step_hooks(self) -> tuple:
        """The runner hooks this recorder attached (:func:`.runner_hooks.attach`)."""
        return (self.before_step, self.after_step)

    def close(self) -> None:
        self.drain()
        with self.lock:
            try:
                line = self.drafts.close()
                if line:
                    logger.info("%s", line)
            finally:  # the open file is closed whatever the drafts' summary met
                if self.writer is not None:
                    self._close_writer()
                    logger.info("smoe record: closed at shutdown; %d tokens in %d steps recorded to %s in all",
                                self.total, self.step, self.cfg.record)


def install_recorder(model, vllm_config, cfg: SmoeConfig, location=None, order=None) -> Recorder:
    """Hook the routers of ``model`` and the runner's step; called by the smoe loader after the
    token order (``order``, speculate) is in place."""
    from vllm.platforms import current_platform

    from .. import runner_hooks

    rec = Recorder(model, vllm_config, cfg, location, order)
    runner_hooks.attach(before=rec.before_step, after=rec.after_step)
    runner_hooks.check_attached(vllm_config, current_platform.device_type)  # never record nothing silently
    logger.info("smoe record: capturing %d MoE layers into %s (%s of requests%s)", rec.L, cfg.record,
                f"{cfg.record_sample:.0%}", "" if cfg.record_max_mb is None else f", at most {cfg.record_max_mb:g} MiB")
    return rec

