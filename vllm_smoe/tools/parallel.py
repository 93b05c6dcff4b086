"""An ordered map over worker processes that reach the caller's data by fork, not by pickling.

smoe-place solves layers independently from counts that can take gigabytes; forked workers read
them copy-on-write, and only each layer's result travels back: large arrays as files in shared
memory (``/dev/shm``), the rest through the pool's pipe.
"""

from __future__ import annotations

import errno
import itertools
import multiprocessing
import os
import tempfile
from typing import Callable, Iterable, Iterator

import numpy as np

_FN: Callable | None = None  # set in the parent just before the fork, inherited by the workers
_PARK: str | None = None  # path prefix of this call's parked arrays, inherited likewise
_SHARE_BYTES = 1 << 20  # arrays from this size are parked in a file, not pickled through the pipe
_CALLS = itertools.count()


class _Parked:
    """A worker's array written to a file in shared memory: one memcpy each way instead of
    pickling through a pipe in 64 KiB pieces. The parent reads it back and removes the file."""

    def __init__(self, path: str, shape, dtype):
        self.path, self.shape, self.dtype = path, shape, dtype

    def take(self) -> np.ndarray:
        try:
            return np.fromfile(self.path, dtype=self.dtype).reshape(self.shape)
        finally:
            os.unlink(self.path)


def _park(a: np.ndarray, path: str):
    """The array as a :class:`_Parked` file, or itself when the space is not there (a small
    ``/dev/shm`` in a container): the pipe is slower, never wrong."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(a.nbytes, 1))  # ENOSPC now, not SIGBUS later
        with os.fdopen(fd, "wb", closefd=False) as f:
            np.ascontiguousarray(a).tofile(f)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            return a
        raise
    os.close(fd)
    return _Parked(path, a.shape, a.dtype)


def _pack(x, path: str):
    if isinstance(x, np.ndarray) and x.nbytes >= _SHARE_BYTES:
        return _park(x, path)
    if isinstance(x, tuple):
        return tuple(_pack(v, f"{path}.{i}") for i, v in enumerate(x))
    return x


def _unpack(x):
    if isinstance(x, _Parked):
        return x.take()
    return tuple(_unpack(v) for v in x) if isinstance(x, tuple) else x


def _call(index_item):
    index, item = index_item
    return _pack(_FN(item), f"{_PARK}{index}")


def _park_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def default_jobs() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def fork_map(fn: Callable, items: Iterable, jobs: int) -> Iterator:
    """``map(fn, items)`` in order, over ``jobs`` forked processes (in this process when
    ``jobs`` <= 1 or fork is unavailable). ``fn`` may be any callable, closures included.

    At most ``jobs + 1`` items are in flight, so finished results never pile up. A worker that
    dies (killed, out of memory) raises ``ChildProcessError`` here instead of hanging; an
    exception in ``fn`` is raised at its item. Parked arrays are removed however the map ends."""
    items = list(items)
    if jobs <= 1 or len(items) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        yield from map(fn, items)
        return
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    from threadpoolctl import threadpool_limits

    global _FN, _PARK
    prefix = os.path.join(_park_dir(), f"smoe-{os.getpid()}-{next(_CALLS)}-")
    _FN, _PARK = fn, prefix
    pool = ProcessPoolExecutor(min(jobs, len(items)), mp_context=multiprocessing.get_context("fork"))
    pending = {}
    # one BLAS thread per process: jobs processes already fill the cores, and BLAS threads
    # spinning against them slowed smoe-place's solve 1.6x on 2 cores
    limits = threadpool_limits(limits=1)
    try:
        todo = iter(enumerate(items))
        for index, item in itertools.islice(todo, jobs + 1):
            pending[index] = pool.submit(_call, (index, item))
        for index in range(len(items)):
            try:  # a dead worker breaks the pool: the wait or the next submit says so
                out = pending.pop(index).result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending[nxt[0]] = pool.submit(_call, nxt)
            except BrokenProcessPool:
                raise ChildProcessError(f"a worker process died by item {index} (killed, or out of memory: "
                                        f"fewer jobs need less)") from None
            yield _unpack(out)
    finally:
        for f in pending.values():
            f.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        limits.restore_original_limits()
        _FN = _PARK = None
        import glob

        for path in glob.glob(glob.escape(prefix) + "*"):  # results nobody took
            os.unlink(path)


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
