"""The API server's side of a live re-placement: :func:`swap` takes a placement file from a path
to serving on every worker, or refuses it with a :class:`SwapError` (an HTTP status and a
detail). ``POST /smoe/placement`` answers with it; anything else in the API server that
re-places (a controller) calls it too, so every swap passes the same checks, lock and deadline.

The steps, in order and why: :func:`swap`.

A move that fails or misses its deadline leaves the weights in an unknown state: the server
stops (:func:`_stop_server`) rather than answer from a half-moved model, and /health answers
503 from the moment the move is overdue (:meth:`LiveState.unhealthy`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass, field

EXTENSION = "vllm_smoe.serving.place.live.SmoeWorkerExtension"
READ_S = 120.0  # reading and checking a file: bounded bytes, so only a stalled file system takes longer
PREPARE_S = 300.0  # collective_rpc timeout for parsing and checking a placement on every worker
# the move's deadline: a fixed part plus the rank's changing expert bytes at a slow link's rate
APPLY_BASE_S, APPLY_BYTES_PER_S = 60.0, 50e6
ANSWER_GRACE_S = 30.0  # past an RPC's own timeout (the engine core's), the API server stops waiting
POLL_S = 0.2  # how often a wait on the engine looks whether the server is stopping
logger = logging.getLogger("vllm.smoe")


class SwapError(Exception):
    """A swap refused or failed: ``status`` is its HTTP status (400 the file, 404 nothing served,
    409 this server takes no swap, 500 the move failed, 503 the server is stopping), ``detail``
    one line naming the file and field."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


@dataclass
class LiveState:
    """What the API server knows of live swaps (``app.state.smoe_live``), changed only by
    :func:`swap`."""

    engine: object  # vLLM's EngineClient: collective_rpc; ``errored`` once it stopped or died
    vllm_config: object
    cfg: object  # SmoeConfig (placement_dirs: where files may come from)
    path: str | None  # the placement served now; None: none, nothing to swap
    refused: str = ""  # why this server takes no swap ('' = it does), from its layout at start
    like: object = None  # Placement of the served model's shape (bounds a new YAML); None: 16 MiB
    swaps: int = 0
    last: dict | None = None  # the last swap's answer
    failed: str = ""  # why a move failed: the weights are in an unknown state and the server stops
    move_deadline: float | None = None  # time.monotonic() by which the move in flight must end
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def start(cls, engine, vllm_config, cfg) -> "LiveState":
        """A server's state at start: serving ``cfg.placement`` (parsed already by the start checks)."""
        like = None
        if cfg.placement is not None:
            from ..served import placement_for

            like = placement_for(cfg).placement
        return cls(engine, vllm_config, cfg, cfg.placement, live_refused(vllm_config), like)

    def stopping(self) -> str:
        """Why the server is stopping ('' = it is not): a failed move, or vLLM's shutdown (which
        stops the engine client before it waits for open requests), or a dead engine."""
        if self.failed:
            return self.failed
        if getattr(self.engine, "errored", False):
            return "the server is stopping (its engine has stopped)"
        return ""

    def unhealthy(self) -> str:
        """Why /health answers 503 ('' = swaps give no reason): a failed move (the server stops) or
        a move past its deadline (it stops unless the move ends)."""
        if self.failed:
            return self.failed
        if self.move_deadline is not None and time.monotonic() > self.move_deadline:
            return "a live swap's move is past its deadline; the server stops unless it ends"
        return ""


async def swap(live: LiveState, path: str, extra_dirs: tuple[str, ...] = ()) -> dict:
    """Serve the placement at ``path`` on every worker, all or none (the steps below). Files
    are taken from ``live.cfg.placement_dirs`` and ``extra_dirs`` (a caller's own, e.g. where a
    controller writes candidates). Returns ``{"placement", "previous", "moved_slots",
    "moved_bytes", "seconds", "worker_seconds"}``; raises :class:`SwapError`. Shielded: a caller
    cancelled meanwhile (a client gone) does not cut a swap short; it ends and is recorded.

    Order, and why:

    1. The file is resolved and read once, only from the allowed directories, bounded by what a
       placement of the served model can need, and checked exactly as a start would, all off the
       swap lock and under a time limit: a big, slow or hostile file delays no other swap.
    2. Under the lock (one swap at a time), two ``collective_rpc`` calls that vLLM's engine core runs
       between steps (:class:`~.live.SmoeWorkerExtension`): *prepare* (every worker parses the bytes
       read here, never the path, and allocates; any refusal stops here, nothing changed) and
       *apply* (the move, under :func:`apply_deadline`).
    3. Every wait on the engine also watches whether the server is stopping: vLLM's shutdown (a
       SIGINT / SIGTERM) stops the engine client first, then waits for open requests, so a swap
       whose engine is gone answers at once (503) instead of holding the server up forever."""
    task = asyncio.ensure_future(_swap(live, os.path.abspath(path), tuple(extra_dirs)))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if nobody awaits it
    return await asyncio.shield(task)


async def _swap(live: LiveState, path: str, extra_dirs: tuple[str, ...]) -> dict:
    if live.path is None:
        raise SwapError(404, "this server runs without an smoe placement (--plugin smoe --smoe-placement P): "
                             "nothing to swap")
    _refuse_if_closed(live)
    snap = await _read(live, path, extra_dirs)
    async with live.lock:  # one swap at a time
        _refuse_if_closed(live)
        t0 = time.monotonic()
        # every worker parses these bytes, never the path, and allocates the transfer buffers;
        # apply then only moves, so whatever can be refused is refused, on every worker, before
        # a byte moves
        try:
            ready = await _call(live, "smoe_prepare_placement", PREPARE_S, snap.path, snap.yaml, snap.tables,
                                snap.sha256)
        except _Stopping as e:
            raise SwapError(503, f"{path} not swapped in: {e}") from None
        reasons = [r["reason"] for r in ready if r["reason"]]
        if reasons:  # the ranks that were ready free what they allocated
            try:
                await _call(live, "smoe_cancel_placement", PREPARE_S)
            except _Stopping:
                pass  # the engine is gone, and what it allocated with it
            raise SwapError(400, reasons[0])
        deadline = apply_deadline(max(r["bytes"] for r in ready))
        live.move_deadline = time.monotonic() + deadline
        try:
            done = await _call(live, "smoe_apply_placement", deadline, snap.sha256)
        except Exception as e:  # noqa: BLE001 - the weights are in an unknown state: stop serving
            stopping = live.stopping()
            live.failed = (f"a live swap to {path} failed while weights moved ({type(e).__name__}: {e}; its "
                           f"deadline was {deadline:.0f} s); this server stops rather than answer from a "
                           f"half-moved model")
            logger.error("smoe: %s", live.failed)
            if stopping:  # stopping already (a signal, a dead engine): nothing more to do
                raise SwapError(503, live.failed) from None
            asyncio.get_running_loop().call_later(0.5, _stop_server)  # after the answer is out
            raise SwapError(500, live.failed) from None
        finally:
            live.move_deadline = None
        answer = {"placement": path, "previous": live.path, "moved_slots": done[0]["moved_slots"],
                  # expert weight bytes written into changed slots, all ranks together
                  "moved_bytes": sum(r["bytes"] for r in ready),
                  "seconds": time.monotonic() - t0, "worker_seconds": max(d["seconds"] for d in done)}
        live.path, live.last = path, answer
        live.swaps += 1
    return answer


def _refuse_if_closed(live: LiveState) -> None:
    if live.failed or live.refused:
        raise SwapError(409, live.failed or live.refused)
    if stopping := live.stopping():
        raise SwapError(503, stopping)


async def _read(live: LiveState, path: str, extra_dirs: tuple[str, ...]):
    """The file read once and checked as a start would, off the event loop and the lock, within
    :data:`READ_S`; SwapError 400 naming the file otherwise."""
    from ...formats.placement_file import read_snapshot
    from .check import check_served_placement

    dirs = live.cfg.placement_dirs
    if dirs is not None and extra_dirs:
        dirs = (*dirs, *extra_dirs)

    def read_and_check():
        snap = read_snapshot(path, dirs, live.like)
        # the API server's own check first: a bad file never reaches the engine
        check_served_placement(snap.path, live.cfg, live.vllm_config, snap)
        return snap

    try:
        return await asyncio.wait_for(asyncio.to_thread(read_and_check), READ_S)
    except ValueError as e:
        raise SwapError(400, str(e)) from None
    except TimeoutError:
        raise SwapError(400, f"{path}: not read and checked within {READ_S:.0f} s (a stalled file system?); "
                             f"nothing changed") from None


class _Stopping(Exception):
    """The server stopped while an engine call was out."""


async def _call(live: LiveState, method: str, timeout: float, *args):
    """``collective_rpc(method)``, waited for until it answers, the server stops (:class:`_Stopping`)
    or its timeout plus :data:`ANSWER_GRACE_S` passes (TimeoutError): an engine that was stopped
    never answers, and vLLM's client has no timeout of its own."""
    loop = asyncio.get_running_loop()
    call = asyncio.ensure_future(live.engine.collective_rpc(method, timeout=timeout, args=args))
    end = loop.time() + timeout + ANSWER_GRACE_S
    try:
        while True:
            done, _ = await asyncio.wait({call}, timeout=POLL_S)
            if done:
                return call.result()
            if why := live.stopping():
                raise _Stopping(why)
            if loop.time() > end:
                raise TimeoutError(f"no answer to {method} within {timeout + ANSWER_GRACE_S:.0f} s")
    finally:
        call.cancel()  # a no-op once it answered


def apply_deadline(moved_bytes: int) -> float:
    """Seconds a swap's weight move may take before the server gives up and stops (a rank that
    cannot finish would otherwise hold every other rank in the transfer, behind a healthy
    /health): generous for a slow link, never the collective timeout's half hour."""
    return APPLY_BASE_S + moved_bytes / APPLY_BYTES_PER_S


def _stop_server() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # vLLM's API server shuts its engines down on SIGTERM


def live_refused(vllm_config) -> str:
    """Why this server cannot swap placements live ('' = it can)."""
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1:
        return ("live re-placement needs --data-parallel-size 1: DP engines step on their own, so no moment lies "
                "between the steps of all of them; restart with the new placement")
    if pc.pipeline_parallel_size > 1:
        return "live re-placement needs --pipeline-parallel-size 1; restart with the new placement"
    if pc.enable_eplb:
        return ("--enable-eplb moves experts at run time, so the served layout is no longer the placement's; "
                "restart with the new placement")
    if getattr(pc, "_api_process_count", 1) > 1:
        return ("live re-placement needs one API server (--api-server-count 1): each would swap on its own; "
                "restart with the new placement")
    if pc.worker_extension_cls != EXTENSION:
        return f"--worker-extension-cls {pc.worker_extension_cls} replaces smoe's, which live re-placement calls"
    return ""
