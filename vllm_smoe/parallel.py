"""An ordered map over worker processes that reach the caller's data by fork, not by pickling.

smoe-place solves layers independently from counts that can take gigabytes; forked workers read
them copy-on-write, and only each layer's small result travels back.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Callable, Iterable, Iterator

import numpy as np

_FN: Callable | None = None  # set in the parent just before the fork, inherited by the workers


_SHARE_BYTES = 1 << 20  # arrays from this size travel through shared memory, not the result pipe


class _Shared:
    """A worker's array parked in POSIX shared memory: the parent copies it out and unlinks it
    (one memcpy each way instead of pickling through a pipe in 64 KiB pieces)."""

    def __init__(self, a):
        from multiprocessing import shared_memory

        from multiprocessing import resource_tracker

        shm = shared_memory.SharedMemory(create=True, size=max(a.nbytes, 1))
        # the parent unlinks it: the worker's tracker must not (nor warn at exit that it leaked)
        resource_tracker.unregister(shm._name, "shared_memory")
        np.ndarray(a.shape, a.dtype, buffer=shm.buf)[...] = a
        self.name, self.shape, self.dtype = shm.name, a.shape, a.dtype
        shm.close()

    def take(self):
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(name=self.name)
        try:
            return np.ndarray(self.shape, self.dtype, buffer=shm.buf).copy()
        finally:
            shm.close()
            shm.unlink()


def _pack(x):
    if isinstance(x, np.ndarray) and x.nbytes >= _SHARE_BYTES:
        return _Shared(x)
    return tuple(_pack(v) for v in x) if isinstance(x, tuple) else x


def _unpack(x):
    if isinstance(x, _Shared):
        return x.take()
    return tuple(_unpack(v) for v in x) if isinstance(x, tuple) else x


def _call(item):
    return _pack(_FN(item))


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
    from threadpoolctl import threadpool_limits

    global _FN
    _FN = fn
    # one BLAS thread per process: jobs processes already fill the cores, and BLAS threads
    # spinning against them slowed smoe-place's solve 1.6x on 2 cores
    try:
        with threadpool_limits(limits=1), multiprocessing.get_context("fork").Pool(min(jobs, len(items))) as pool:
            for out in pool.imap(_call, items):
                yield _unpack(out)
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


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {key}")


def start_peak_rss() -> int:
    """Reset this process's resident high-water mark (Linux clear_refs 5) and return the resident
    bytes now: :func:`peak_rss_since` then measures the extra memory of the work in between at
    no cost to it (tracemalloc slowed smoe-place's solve by a third). -1 where /proc cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024
    except OSError:
        return -1


def peak_rss_since(base: int) -> int:
    """Peak resident bytes above ``base`` (from :func:`start_peak_rss`) since then; 0 if unknown."""
    if base < 0:
        return 0
    try:
        return max(0, _status_kb("VmHWM") * 1024 - base)
    except OSError:
        return 0
