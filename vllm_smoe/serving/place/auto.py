"""Automatic re-placement: when drift holds, a candidate is built from the recent recording off
the serving path, judged on held-out recent traffic, and swapped in through the live-swap path.

State and policy live here (:class:`AutoReplace`: pure, a clock passed in); the candidate build
is a low-priority child process with its own limits (:mod:`.auto_build`); :func:`run` is the
loop the API server runs, which swaps through the same function as ``POST /smoe/placement``
(all ranks or none, the deadline). Every decision is logged and counted (published as the
``auto`` source of the metrics directory, served on ``/metrics``). Nothing here raises into
serving: a failure of the controller is counted and logged, and serving goes on.

Why no DP placements: a ``--mode dp`` placement is served by DP engines that step on their
own, which a live swap cannot move together (``POST /smoe/placement`` answers 409 at DP > 1);
such a server is refused at start with ``auto_replace``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time

from ..observe.drift import pooled_drift
from .auto_settings import AutoSettings  # noqa: F401 (re-exported)

logger = logging.getLogger("vllm.smoe")

SOURCE = "auto"  # the metrics directory's source name for the controller's counters
REASONS = ("margin", "build_failed", "invalid", "swap_refused", "no_recording")  # why a candidate was not swapped


class AutoReplace:
    """The controller's state and policy. :meth:`observe` takes each interval's drift verdict
    and says when to build; :meth:`judge` takes the build's held-out numbers; the rest record
    what happened. ``counters`` is what ``/metrics`` publishes (cumulative)."""

    def __init__(self, settings: AutoSettings, now: float):
        self.settings = settings
        self.drift_since: float | None = None  # when the current run of drifted verdicts began
        self.quiet_until = now  # no build before (a cool-down after a swap or a rejection)
        self.counters = {"checks": 0, "drifted_checks": 0, "candidates": 0, "swaps": 0, "moved_slots": 0,
                         "moved_bytes": 0, "build_seconds": 0.0, "build_cpu_seconds": 0.0,
                         "swap_seconds": 0.0, "failures": 0,
                         "rejected": {r: 0 for r in REASONS}}
        self.last: dict | None = None  # the last decision, as logged
        self.waiting = False  # this drift run's wait for a recording was logged

    def observe(self, drifted: bool | None, now: float) -> bool:
        """One interval's verdict (None: not judged, which breaks a run of drifted ones). True
        when drift has held for ``hold_s`` and the cool-down is over: build a candidate now."""
        self.counters["checks"] += 1
        if not drifted:
            self.drift_since, self.waiting = None, False
            return False
        self.counters["drifted_checks"] += 1
        if self.drift_since is None:
            self.drift_since = now
        return now - self.drift_since >= self.settings.hold_s and now >= self.quiet_until

    def judge(self, served_lar: float, candidate_lar: float) -> tuple[bool, str]:
        """(swap?, why): the candidate's held-out ratio against the served one's plus the margin."""
        need = served_lar * (1.0 + self.settings.margin)
        if candidate_lar > need:
            return True, f"held-out local activation ratio {candidate_lar:.4f} > {need:.4f} (served {served_lar:.4f} " \
                         f"x (1 + margin {self.settings.margin:g}))"
        return False, f"held-out local activation ratio {candidate_lar:.4f} <= {need:.4f} (served " \
                      f"{served_lar:.4f} x (1 + margin {self.settings.margin:g}))"

    def built(self, seconds: float, cpu_seconds: float = 0.0) -> None:
        self.counters["candidates"] += 1
        self.counters["build_seconds"] += seconds
        self.counters["build_cpu_seconds"] += cpu_seconds

    def rejected(self, reason: str, detail: str, now: float) -> None:
        """No swap this time: counted by reason; the next build waits a cool-down (the traffic
        that made this candidate would make the same one)."""
        assert reason in REASONS, reason
        self.counters["rejected"][reason] += 1
        self.quiet_until = now + self.settings.cooldown_s
        self.drift_since, self.waiting = None, False
        self._say({"decision": "rejected", "reason": reason, "detail": detail})

    def too_early(self, detail: str, now: float) -> None:
        """Too little recorded since drift began to build from: counted as ``no_recording``; the
        drift run goes on and the next try comes one ``hold_s`` later, not after a cool-down (the
        recording grows with the traffic that drifted). Logged once per drift run."""
        self.counters["rejected"]["no_recording"] += 1
        self.quiet_until = now + max(self.settings.hold_s, 1.0)
        if not self.waiting:
            self._say({"decision": "waiting", "reason": "no_recording", "detail": detail})
        self.waiting = True

    def swapped(self, answer: dict, now: float) -> None:
        self.counters["swaps"] += 1
        self.counters["moved_slots"] += int(answer.get("moved_slots", 0))
        self.counters["moved_bytes"] += int(answer.get("moved_bytes", 0))
        self.counters["swap_seconds"] += float(answer.get("seconds", 0.0))
        self.quiet_until = now + self.settings.cooldown_s
        self.drift_since, self.waiting = None, False
        self._say({"decision": "swapped", **{k: answer[k] for k in ("placement", "previous", "moved_slots",
                                                                     "moved_bytes", "seconds") if k in answer}})

    def failed(self, detail: str, now: float) -> None:
        """The controller itself failed (a bug, an I/O error): counted, serving goes on."""
        self.counters["failures"] += 1
        self.quiet_until = now + self.settings.cooldown_s
        self.drift_since, self.waiting = None, False
        self._say({"decision": "failed", "detail": detail})

    def _say(self, decision: dict) -> None:
        self.last = decision
        logger.info("smoe: auto-replace: %s", ", ".join(f"{k}={v}" for k, v in decision.items()))


async def _off_loop(fn, *args):
    """``fn(*args)`` on a daemon thread of its own: unlike asyncio's thread pool, which the
    interpreter joins at exit, a build still running when the server stops never holds the exit
    (its child process dies with that thread: :func:`.auto_build._limits`)."""
    import threading

    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():  # the loop's task may have been cancelled meanwhile
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def target() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed: the server is gone
            pass

    threading.Thread(target=target, daemon=True, name="smoe-auto-build").start()
    return await fut


async def run(ctl: AutoReplace, *, served_path, record_dir: str, metrics_dir: str, interval: float, swap,
              build, publish, clock=time.monotonic, workdir: str | None = None) -> None:
    """The controller's loop (an asyncio task of the API server; cancel it to stop). Each
    ``interval``: the pooled drift verdict from ``metrics_dir``; when :meth:`AutoReplace.observe`
    says so, ``build(served, record_dir, out, settings, since)`` in a thread (it runs the child
    process on what was recorded since ``since``, the wall-clock time drift began; returns
    {"placement", "served_lar", "candidate_lar", "seconds", "cpu_seconds"} or raises
    :class:`~.auto_build.BuildError`), then ``await swap(path, extra_dirs)``: the live-swap path,
    raising on refusal. ``served_path()``: the placement served now; ``publish(counters)``:
    writes the controller's counters where ``/metrics`` reads them."""
    from ..observe.metrics import read_snapshots
    from .auto_build import BuildError

    workdir = workdir or tempfile.mkdtemp(prefix="smoe-auto-")  # 0700: candidates only the server reads
    publish(ctl.counters)
    while True:
        await asyncio.sleep(interval)
        now = clock()
        try:
            verdict = pooled_drift(await asyncio.to_thread(read_snapshots, metrics_dir))
            go = ctl.observe(None if verdict is None else verdict["drifted"], now)
            if go:
                (logger.debug if ctl.waiting else logger.info)(  # a retry while waiting for a recording: once
                    "smoe: auto-replace: drift held %.0f s (window ratio %.4f < %g x expected %.4f): building a "
                    "candidate from %s", now - ctl.drift_since, verdict["ratio"], verdict["threshold"],
                    verdict["expected"], record_dir)
                out = os.path.join(workdir, f"candidate-{ctl.counters['candidates'] + 1}.yaml")
                since = time.time() - (now - ctl.drift_since)
                try:
                    got = await _off_loop(build, served_path(), record_dir, out, ctl.settings, since)
                except BuildError as e:
                    if e.reason == "no_recording":
                        ctl.too_early(str(e), clock())
                    else:
                        ctl.rejected(e.reason, str(e), clock())
                else:
                    ctl.built(got["seconds"], got.get("cpu_seconds", 0.0))
                    ok, why = ctl.judge(got["served_lar"], got["candidate_lar"])
                    if not ok:
                        ctl.rejected("margin", why, clock())
                    else:
                        logger.info("smoe: auto-replace: swapping in %s: %s", out, why)
                        try:
                            answer = await swap(out, (workdir,))
                        except Exception as e:  # noqa: BLE001 - the swap path's refusal (the file, the engine)
                            reason = "invalid" if getattr(e, "status", None) == 400 else "swap_refused"
                            ctl.rejected(reason, f"{type(e).__name__}: {getattr(e, 'detail', e)}", clock())
                        else:
                            ctl.swapped(answer, clock())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never into serving
            logger.exception("smoe: auto-replace failed; serving goes on")
            ctl.failed(f"{type(e).__name__}: {e}", clock())
        try:
            publish(ctl.counters)
        except OSError as e:
            logger.warning("smoe: auto-replace: could not publish its counters: %s", e)


def start(live, cfg) -> "asyncio.Task":
    """The controller of this API server (an asyncio task on its loop), for ``cfg.auto_replace``;
    ``live``: the server's :class:`~.swap.LiveState`, through whose :func:`~.swap.swap` it swaps."""
    from functools import partial

    from ...placement.online import PREDICTORS as SIMULATED
    from ..observe.metrics import metrics_dir, publish
    from .auto_build import build_candidate
    from .swap import swap

    directory = metrics_dir(cfg)
    # advise judges with serving's predictor where it can simulate it (its default, tables, otherwise)
    predictor = cfg.predictor if cfg.mode == "speculate" and cfg.predictor in SIMULATED else None
    ctl = AutoReplace(cfg.auto_replace, time.monotonic())
    logger.info("smoe: auto-replace on: %s", ", ".join(f"{k}={v:g}" for k, v in cfg.auto_replace.to_dict().items()))
    return asyncio.get_running_loop().create_task(run(
        ctl, served_path=lambda: live.path, record_dir=cfg.record, metrics_dir=directory, interval=cfg.log_interval,
        swap=partial(swap, live), build=partial(build_candidate, predictor=predictor),
        publish=lambda c: publish(directory, SOURCE, 0, c)))


def refused(cfg, vllm_config) -> str:
    """Why ``auto_replace`` cannot run on this server ('' = it can): a live swap's own refusals
    (DP > 1, PP, EPLB, several API servers: :func:`~.swap.live_refused`), metrics off (no drift
    verdict), or vLLM's endpoint plugins not loading smoe's (the controller runs there)."""
    from .swap import live_refused

    why = live_refused(vllm_config)
    if why:
        return why
    if not cfg.metrics:
        return "field 'metrics' is off: the controller acts on the drift verdict the metrics carry"
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is None or "smoe" not in [p.strip() for p in allowed.split(",")]:
        return ("VLLM_PLUGINS does not name smoe: vLLM loads endpoint plugins only when named there, and the "
                "controller runs in smoe's, beside POST /smoe/placement; start with VLLM_PLUGINS=smoe")
    return ""
