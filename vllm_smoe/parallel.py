"""An ordered map over worker processes that reach the caller's data by fork, not by pickling.

smoe-place solves layers independently from counts that can take gigabytes; forked workers read
them copy-on-write, and only each layer's small result travels back.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Iterable, Iterator

_FN: Callable | None = None  # set in the parent just before the fork, inherited by the workers


def _call(item):
    return _FN(item)


def default_jobs() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fork_map(fn: Callable, items: Iterable, jobs: int) -> Iterator:
    """``map(fn, items)`` in order, over ``jobs`` forked processes (in this process when
    ``jobs`` <= 1 or fork is unavailable). ``fn`` may be any callable, closures included."""
    items = list(items)
    if jobs <= 1 or len(items) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(fn, items)
        return
    global _FN
    _FN = fn
    try:
        with multiprocessing.get_context("fork").Pool(min(jobs, len(items))) as pool:
            yield from pool.imap(_call, items)
    finally:
        _FN = None


def children_peak_rss_mb() -> float:
    """Largest peak resident memory of any waited-for child process, MiB (Linux: ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def prefetch(iterable: Iterable, depth: int = 2) -> Iterator:
    """Iterate ``iterable`` in a background thread, ``depth`` items ahead: reading and
    decompressing the next chunk (zlib and numpy release the GIL) overlaps counting this one.
    Exceptions reach the consumer at the item where they happened."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def put(x) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce():
        try:
            for item in iterable:
                if not put((item, None)):
                    return
            put((done, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((done, e))

    t = threading.Thread(target=produce, name="smoe-prefetch", daemon=True)
    t.start()
    try:
        while True:
            item, err = q.get()
            if item is done:
                if err is not None:
                    raise err
                return
            yield item
    finally:
        stop.set()
        t.join(timeout=5)
