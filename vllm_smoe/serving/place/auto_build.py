"""The automatic re-placement's candidate build: ``smoe-place advise`` on the recent recording,
in a child process at the lowest CPU priority, one thread, with its own address-space, CPU-time
and wall-clock limits, so serving keeps its cores and memory whatever the recording holds.

advise trains the candidate on the first half of the recording's steps and scores the served
placement and the candidate on the second half (held-out recent traffic); with ``--max-moves``
the candidate moves at most that share of the served slots, which is what a live swap moves.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

# advise's results are keyed "served (<method>)", "candidate (<method>)", "limited (at most F of slots moved)"
_SERVED, _LIMITED = "served (", "limited ("


class BuildError(Exception):
    """No candidate this time; ``reason`` is one of :data:`.auto.REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def recent_files(record_dir: str, since: float | None, window_tokens: int) -> list[str]:
    """The recorder's closed trace files (``trace-*.npz``, written atomically) last modified at
    or after ``since`` (wall-clock seconds; None: any), newest first while their tokens fit in
    ``window_tokens`` (at least the newest one): the traffic since drift began, bounded."""
    from ...formats.trace import open_trace

    files = []
    for path in glob.glob(os.path.join(record_dir, "trace-*.npz")):
        try:
            mtime = os.stat(path).st_mtime
        except OSError:  # rotated away by the disk budget meanwhile
            continue
        if since is None or mtime >= since:
            files.append((mtime, path))
    out, tokens = [], 0
    for _, path in sorted(files, reverse=True):
        try:
            n = open_trace(path).num_tokens
        except (OSError, ValueError):
            continue
        if out and tokens + n > window_tokens:
            break
        out.append(path)
        tokens += n
    return out


def _limits(mem_mb: int, cpu_s: float):
    def apply() -> None:  # in the child, before exec
        import ctypes
        import resource
        import signal

        # killed when the thread that started it ends: a server that stops leaves no build behind
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        os.nice(19)
        resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))
        cpu = int(cpu_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    return apply


def advise_command(served: str, files: list[str], out: str, settings, predictor: str | None = None) -> list[str]:
    """The ``smoe-place advise`` command line the controller runs (also what an operator would)."""
    cmd = [sys.executable, "-m", "vllm_smoe.tools.place", "advise", "--trace", *files, "--placement", served,
           "--max-moves", f"{settings.max_moves:g}", "--max-tokens", str(settings.window_tokens),
           "--json", out + ".json", "-o", out, "--jobs", "1"]
    return cmd + (["--predictor", predictor] if predictor else [])


def build_candidate(served: str, record_dir: str, out: str, settings, since: float | None = None,
                    predictor: str | None = None) -> dict:
    """Runs advise (see the module doc) on :func:`recent_files` and reads its judgement:
    {"placement": out, "served_lar", "candidate_lar" (the move-limited candidate's, on the
    held-out half), "seconds", "cpu_seconds" (the child's user + system time), "files"}. Raises
    :class:`BuildError` when there is nothing to build from or the build fails or runs out of
    its limits."""
    files = recent_files(record_dir, since, settings.window_tokens)
    if not files:
        raise BuildError("no_recording", f"{record_dir}: no closed trace file written since drift began")
    tokens = _tokens(files)
    if tokens < settings.min_tokens:
        raise BuildError("no_recording", f"{record_dir}: {tokens} tokens recorded since drift began, fewer than "
                                         f"min_tokens {settings.min_tokens}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t0, cpu0 = time.monotonic(), _child_cpu()
    rc, text = run_throttled(advise_command(served, files, out, settings, predictor), env,
                             _limits(settings.build_mem_mb, settings.build_cpu_s), settings.build_timeout_s,
                             settings.build_cpu_share)
    if rc is None:
        raise BuildError("build_failed", f"smoe-place advise ran past build_timeout_s "
                                         f"{settings.build_timeout_s:g} s")
    seconds, cpu = time.monotonic() - t0, _child_cpu() - cpu0
    if rc != 0:
        tail = text.strip().splitlines()[-1:] or [f"exit {rc}"]
        raise BuildError("build_failed", f"smoe-place advise exited {rc}: {tail[0]}")
    try:
        with open(out + ".json") as f:
            res = json.load(f)
        served_lar = next(v["lar"] for k, v in res.items() if k.startswith(_SERVED))
        cand_lar = next(v["lar"] for k, v in res.items() if k.startswith(_LIMITED))
    except (OSError, ValueError, StopIteration, KeyError, TypeError) as e:
        raise BuildError("build_failed", f"{out}.json: no served and limited 'lar' ({type(e).__name__})") from None
    return {"placement": out, "served_lar": float(served_lar), "candidate_lar": float(cand_lar), "seconds": seconds,
            "cpu_seconds": cpu, "files": len(files)}


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    """``sig`` to the child's process group (it leads one: ``start_new_session``) while the
    child has not been reaped, so that a reused pid is never signalled."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def _kill_group(p: subprocess.Popen) -> None:
    import signal

    _signal_group(p, signal.SIGKILL)
    p.wait()


PERIOD_S = 0.1  # the throttle's period: run share x PERIOD_S, stopped the rest


def run_throttled(cmd: list[str], env: dict, preexec, timeout_s: float, share: float) -> tuple[int | None, str]:
    """Runs ``cmd`` to its end, at most ``share`` of one core's time when share < 1 (SIGSTOP /
    SIGCONT each :data:`PERIOD_S`), killed after ``timeout_s`` of wall clock. Returns (exit code,
    or None when it was killed for time; its stderr, else its stdout)."""
    import signal
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        # its own process group: the throttle and a kill for time reach whatever it forks
        p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, preexec_fn=preexec, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        try:
            while p.poll() is None and time.monotonic() < deadline:
                if share >= 1.0:
                    try:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
                    continue
                time.sleep(share * PERIOD_S)
                if p.poll() is None:
                    _signal_group(p, signal.SIGSTOP)
                    time.sleep((1.0 - share) * PERIOD_S)
                    _signal_group(p, signal.SIGCONT)
        except BaseException:
            _kill_group(p)
            raise
        if p.poll() is None:
            _kill_group(p)
            return None, ""
        out.seek(0)
        err.seek(0)
        return p.returncode, err.read() or out.read()


def _tokens(files: list[str]) -> int:
    from ...formats.trace import open_trace

    return sum(open_trace(f).num_tokens for f in files)


def _child_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for children: this build's, once it returned
    return r.ru_utime + r.ru_stime
