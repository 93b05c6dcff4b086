"""Writing a routing trace: :class:`TraceWriter` appends chunks to per-field spill files and
assembles the ``.npz`` at :meth:`TraceWriter.close`, atomically (a reader never sees a
half-written file)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np

from .trace_meta import FIELD2SPEC, MAX_META_CHARS, REQUIRED_FIELDS, TraceMeta
from .trace_spill import SPILL_INDEX, SPILL_PREFIX, assemble, try_lock


def _write_all(f, data: memoryview) -> None:
    """Every byte of ``data`` to the unbuffered file ``f``, or OSError (a raw write may take
    only part of it when the disk fills; the next one then fails)."""
    while len(data):
        n = f.write(data)
        if not n:
            import errno

            raise OSError(errno.ENOSPC, "short write")
        data = data[n:]


class TraceWriter:
    """Append-only writer: ``append`` chunks, ``close`` assembles the ``.npz`` atomically.

    Each field is spilled to a raw file in a temporary directory next to the output
    (``.trace-*``), so memory holds one chunk at a time. Fields present in the first chunk must be
    present in every chunk. Spill writes are unbuffered and the directory holds an index
    (``spill.json``: output path, meta, dtypes) and a lock the writer holds while it lives, so if
    the process dies before ``close`` every appended chunk is already in the operating system's
    hands and :func:`recover_spill` (``smoe-trace recover DIR``) turns the directory into the
    trace. A failed ``close`` (disk full) keeps the directory for that recovery.
    """

    def __init__(self, path: str | os.PathLike, meta: TraceMeta, compresslevel: int = 1):
        self.path = os.fspath(path)
        self.meta = meta
        self.compresslevel = compresslevel
        parent = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(parent):
            raise ValueError(f"{self.path}: directory {parent} does not exist")
        from .bounded import refuse_special

        refuse_special(self.path, "output")  # before any spill data: it could never be renamed there
        if len(meta.to_json()) > MAX_META_CHARS:  # no reader would take the file
            raise ValueError(f"{self.path}: its meta is {len(meta.to_json())} characters of JSON, over the "
                             f"{MAX_META_CHARS} a reader takes")
        self._dir = tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=parent)
        self._lock = try_lock(self._dir)  # a fresh directory: always ours
        self._files: dict[str, object] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._tail: dict[str, tuple[int, ...]] = {}
        self.num_tokens = 0
        self._closed = False
        self._broken = False
        self._appends = 0  # successful ones

    @property
    def spill_dir(self) -> str:
        """The spill directory this writer appends to (gone when someone removed it)."""
        return self._dir

    def _write_index(self) -> None:
        index = {"path": os.path.abspath(self.path), "meta": self.meta.to_json(), "pid": os.getpid(),
                 "compresslevel": self.compresslevel,
                 "fields": {n: {"dtype": np.lib.format.dtype_to_descr(d), "tail": list(self._tail[n])}
                            for n, d in self._dtypes.items()}}
        tmp = os.path.join(self._dir, SPILL_INDEX + ".tmp")
        with open(tmp, "w") as f:
            json.dump(index, f)
        os.replace(tmp, os.path.join(self._dir, SPILL_INDEX))

    def append(self, **arrays: np.ndarray) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: writer already closed")
        unknown = set(arrays) - set(FIELD2SPEC)
        if unknown:
            raise ValueError(f"{self.path}: unknown trace field(s) {sorted(unknown)}")
        if not self._files:
            for name in REQUIRED_FIELDS:
                if name not in arrays:
                    raise ValueError(f"{self.path}: first chunk lacks required field {name!r}")
        elif set(arrays) != set(self._files):
            raise ValueError(
                f"{self.path}: chunk fields {sorted(arrays)} differ from the first chunk's {sorted(self._files)}"
            )
        n = len(arrays["token_ids"])
        chunk = {}
        for name, a in arrays.items():  # every field checked before a byte is written
            a = np.asarray(a)
            dtypes, rank = FIELD2SPEC[name]
            if a.dtype not in dtypes:
                a = a.astype(dtypes[-1] if name != "topk_ids" else self._topk_dtype())
            if a.ndim != rank or a.shape[0] != n:
                raise ValueError(f"{self.path}: field {name!r} chunk has shape {a.shape}, expected {n} rows, rank {rank}")
            if name in self._dtypes and (a.dtype != self._dtypes[name] or a.shape[1:] != self._tail[name]):
                a = a.astype(self._dtypes[name])
                if a.shape[1:] != self._tail[name]:
                    raise ValueError(f"{self.path}: field {name!r} row shape changed to {a.shape[1:]}")
            chunk[name] = np.ascontiguousarray(a)
        for name, a in chunk.items():
            if name not in self._files:
                self._files[name] = open(os.path.join(self._dir, name), "wb", buffering=0)
                self._dtypes[name] = a.dtype
                self._tail[name] = a.shape[1:]
        ends = {name: f.tell() for name, f in self._files.items()}
        try:
            for name, a in chunk.items():
                _write_all(self._files[name], memoryview(a.reshape(-1).view(np.uint8)))
            if self.num_tokens == 0:
                self._write_index()
        except OSError:
            # the chunk is dropped whole (a full disk, a short write): every field back to where
            # it ended, so rows stay aligned and a later append (space back) carries on
            for name, f in self._files.items():
                try:
                    f.truncate(ends[name])
                    f.seek(ends[name])
                except OSError:
                    self._broken = True  # cannot undo: close and recovery refuse the misaligned rows
            raise
        self.num_tokens += n
        self._appends += 1

    def _topk_dtype(self) -> np.dtype:
        return np.dtype(np.int16) if self.meta.num_experts <= np.iinfo(np.int16).max else np.dtype(np.int32)

    def close(self) -> str:
        """Assemble ``path`` atomically and return it. A writer without one successful
        ``append`` leaves no file (its spill is removed) and raises ValueError."""
        if self._closed:
            return self.path
        if not self._appends:  # nothing, or only appends that failed: no file at all
            self.abort()
            raise ValueError(f"{self.path}: no tokens were appended")
        if self._broken:
            self.abort()
            raise ValueError(f"{self.path}: a failed write could not be undone; its rows are dropped")
        for f in self._files.values():
            f.close()
        self._closed = True
        try:
            assemble(self.path, self.meta, self._dir, self._dtypes, self._tail, self.num_tokens, self.compresslevel)
        except BaseException:
            if self._lock is not None:
                self._lock.close()  # the spill data stays, recoverable
            raise
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()
        return self.path

    def abort(self) -> None:
        """Close and remove the spill: nothing appended is kept."""
        self.release()
        shutil.rmtree(self._dir, ignore_errors=True)

    def release(self) -> None:
        """Close without assembling, keeping the spill for :func:`recover_spill` (the rows
        appended so far, all complete)."""
        for f in self._files.values():
            try:
                f.close()
            except OSError:
                pass
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_trace(path: str | os.PathLike, meta: TraceMeta, **arrays: np.ndarray) -> str:
    """Write a whole in-memory trace (convenience over :class:`TraceWriter`)."""
    with TraceWriter(path, meta) as w:
        w.append(**arrays)
    return os.fspath(path)
