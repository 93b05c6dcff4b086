"""Routing traces: the interchange format between serving (record) and smoe-place.

One ``.npz`` (zip of ``.npy`` members, as ``numpy.savez_compressed`` writes), one row per token
the model processed. T = tokens, L = MoE layers, K = top-k.

=============== ======================== =====================================================
field           shape, dtype             meaning
=============== ======================== =====================================================
token_ids       [T] int32                input token id, 0 <= id < vocab_size
request_ids     [T] int32                request the token belongs to
positions       [T] int32                position inside its request, >= 0
topk_ids        [T, L, K] int16|int32    logical expert ids chosen at each MoE layer
meta            0-d str (JSON)           num_experts, top_k, num_layers, vocab_size (required);
                                         domains, model, hidden_size (optional); the
                                         recorder adds dp_rank and, speculating,
                                         token_order ("layer" | "step": one order
                                         per MoE layer or per engine step)
step_ids        [T] int32 (optional)     engine step (= batch) the token was scheduled in
is_prefill      [T] bool (optional)      True for prompt tokens, False for decoded ones
domain          [T] int (optional)       index into meta["domains"]
topk_weights    [T, L, K] float16|32     router weights of topk_ids (optional), finite
=============== ======================== =====================================================

Reading is lazy: :func:`open_trace` reads only the zip directory and the small ``meta``;
:meth:`Trace.iter_chunks` streams rows from the compressed members, so traces larger than
memory can be validated and scanned. :class:`TraceWriter` appends chunks to per-field spill
files and assembles the ``.npz`` at :meth:`TraceWriter.close`, atomically (a reader never sees
a half-written file).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

import numpy as np

from .bounded import regular_file, short

FORMAT_VERSION = 1

# name -> (allowed dtypes, rank). Rank 1 fields are [T]; rank 3 are [T, L, K].
_FIELDS: dict[str, tuple[tuple[np.dtype, ...], int]] = {
    "token_ids": ((np.dtype(np.int32),), 1),
    "request_ids": ((np.dtype(np.int32),), 1),
    "positions": ((np.dtype(np.int32),), 1),
    "topk_ids": ((np.dtype(np.int16), np.dtype(np.int32)), 3),
    "step_ids": ((np.dtype(np.int32),), 1),
    "is_prefill": ((np.dtype(np.bool_),), 1),
    "domain": (tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64)), 1),
    "topk_weights": ((np.dtype(np.float16), np.dtype(np.float32)), 3),
}
REQUIRED_FIELDS = ("token_ids", "request_ids", "positions", "topk_ids")
OPTIONAL_FIELDS = ("step_ids", "is_prefill", "domain", "topk_weights")
_META_REQUIRED = ("num_experts", "top_k", "num_layers", "vocab_size")


@dataclass(frozen=True)
class TraceMeta:
    num_experts: int
    top_k: int
    num_layers: int
    vocab_size: int
    domains: tuple[str, ...] = ()
    model: str | None = None
    hidden_size: int | None = None
    extra: Mapping[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        d: dict[str, object] = dict(self.extra)
        d.update(
            format_version=FORMAT_VERSION,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_layers=self.num_layers,
            vocab_size=self.vocab_size,
        )
        if self.domains:
            d["domains"] = list(self.domains)
        if self.model is not None:
            d["model"] = self.model
        if self.hidden_size is not None:
            d["hidden_size"] = self.hidden_size
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "meta") -> "TraceMeta":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: field 'meta' is not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{where}: field 'meta' must be a JSON object, got {type(d).__name__}")
        for key in _META_REQUIRED:
            if key not in d:
                raise ValueError(f"{where}: field 'meta' lacks required key {key!r}")
            v = d[key]
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{where}: field 'meta.{key}' must be a positive integer, got {v!r}")
        if d["top_k"] > d["num_experts"]:
            raise ValueError(
                f"{where}: field 'meta.top_k' = {d['top_k']} exceeds meta.num_experts = {d['num_experts']}"
            )
        domains = d.get("domains", [])
        if not isinstance(domains, list) or not all(isinstance(s, str) for s in domains):
            raise ValueError(f"{where}: field 'meta.domains' must be a list of strings, got {domains!r}")
        hidden = d.get("hidden_size")
        if hidden is not None and (not isinstance(hidden, int) or hidden <= 0):
            raise ValueError(f"{where}: field 'meta.hidden_size' must be a positive integer, got {hidden!r}")
        known = set(_META_REQUIRED) | {"domains", "model", "hidden_size", "format_version"}
        return cls(
            num_experts=d["num_experts"],
            top_k=d["top_k"],
            num_layers=d["num_layers"],
            vocab_size=d["vocab_size"],
            domains=tuple(domains),
            model=d.get("model"),
            hidden_size=hidden,
            extra={k: v for k, v in d.items() if k not in known},
        )


@dataclass(frozen=True)
class _Member:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    row_bytes: int


@contextlib.contextmanager
def _reading(path: str, what: str = ""):
    """I/O and compression failures while reading ``path`` become ValueErrors naming it."""
    try:
        yield
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise ValueError(f"{path}: {what}damaged data ({type(e).__name__}: {e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def _read_npy_header(fp) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fp)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(fp)
    raise ValueError(f"unsupported .npy version {version}")


class Trace:
    """A routing trace on disk, opened lazily. Use :func:`open_trace`."""

    def __init__(self, path: str, meta: TraceMeta, members: dict[str, _Member]):
        self.path = path
        self.meta = meta
        self._members = members
        self.num_tokens = members["token_ids"].shape[0]

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(n for n in (*REQUIRED_FIELDS, *OPTIONAL_FIELDS) if n in self._members)

    def has(self, name: str) -> bool:
        return name in self._members

    def load(self, name: str) -> np.ndarray:
        """Whole array of one field (materialised in memory)."""
        if name not in self._members:
            raise KeyError(f"{self.path}: trace has no field {name!r}")
        with _reading(self.path, f"field {name!r}: "), np.load(self.path, allow_pickle=False) as z:
            return z[name]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.load(name)

    def iter_chunks(
        self, fields: Sequence[str] | None = None, chunk_tokens: int = 1 << 16
    ) -> Iterator[dict[str, np.ndarray]]:
        """Stream ``{field: rows[start:start+chunk_tokens]}`` without loading whole members."""
        fields = tuple(fields) if fields is not None else self.fields
        for f in fields:
            if f not in self._members:
                raise KeyError(f"{self.path}: trace has no field {f!r}")
        with _reading(self.path):
            zf = zipfile.ZipFile(self.path)
        handles = {}
        try:
            for f in fields:
                m = self._members[f]
                if m.fortran:
                    raise ValueError(f"{self.path}: field {f!r} is stored in Fortran order; rewrite it C-ordered")
                with _reading(self.path, f"field {f!r}: "):
                    fp = zf.open(m.name)
                    _read_npy_header(fp)
                handles[f] = fp
            for start in range(0, self.num_tokens, chunk_tokens):
                n = min(chunk_tokens, self.num_tokens - start)
                out = {}
                for f in fields:
                    m = self._members[f]
                    want = n * m.row_bytes
                    with _reading(self.path, f"field {f!r}: "):
                        buf = handles[f].read(want)
                    if len(buf) != want:
                        raise ValueError(f"{self.path}: field {f!r} is truncated at token {start}")
                    out[f] = np.frombuffer(buf, dtype=m.dtype).reshape((n, *m.shape[1:]))
                yield out
        finally:
            for fp in handles.values():
                fp.close()
            zf.close()


def _inspect_members(path: str) -> tuple[TraceMeta, dict[str, _Member]]:
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such trace file")
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a trace file (smoe-place --trace takes directories)")
    regular_file(path, "trace file")  # a FIFO would block, /dev/zero read until memory runs out
    try:
        zf = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"{path}: not an .npz (zip) file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    with zf, _reading(path):
        members: dict[str, _Member] = {}
        meta_text = None
        for info in zf.infolist():
            if not info.filename.endswith(".npy"):
                continue
            name = info.filename[: -len(".npy")]
            with zf.open(info) as fp:
                try:
                    shape, fortran, dtype = _read_npy_header(fp)
                except ValueError as e:
                    raise ValueError(f"{path}: field {short(name)}: unreadable .npy header ({e})") from None
                claimed = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if claimed > info.file_size:  # before anything is allocated for it
                    raise ValueError(f"{path}: field {short(name)}: its header claims {claimed} bytes but the member "
                                     f"holds {info.file_size}")
                if name == "meta":
                    if shape != () or dtype.kind != "U":
                        raise ValueError(
                            f"{path}: field 'meta' must be a 0-d string array holding JSON, "
                            f"got shape {shape} dtype {dtype}"
                        )
                    meta_text = str(np.frombuffer(fp.read(dtype.itemsize), dtype=dtype)[0])
                    continue
            if dtype.hasobject:
                raise ValueError(f"{path}: field {name!r} has object dtype; not allowed")
            row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize if shape else 0
            members[name] = _Member(info.filename, tuple(shape), dtype, fortran, row)
    if meta_text is None:
        raise ValueError(f"{path}: missing required field 'meta'")
    meta = TraceMeta.from_json(meta_text, where=path)
    return meta, members


def _check_shapes(path: str, meta: TraceMeta, members: dict[str, _Member]) -> None:
    for name in REQUIRED_FIELDS:
        if name not in members:
            raise ValueError(f"{path}: missing required field {name!r}")
    T = members["token_ids"].shape[0] if members["token_ids"].shape else None
    for name, m in members.items():
        if name not in _FIELDS:
            continue  # unknown extra arrays are allowed and ignored
        dtypes, rank = _FIELDS[name]
        if m.dtype not in dtypes:
            allowed = " or ".join(str(d) for d in dtypes)
            raise ValueError(f"{path}: field {name!r} has dtype {m.dtype}, expected {allowed}")
        if len(m.shape) != rank:
            raise ValueError(f"{path}: field {name!r} has rank {len(m.shape)} (shape {m.shape}), expected {rank}")
        if m.shape[0] != T:
            raise ValueError(
                f"{path}: field {name!r} has {m.shape[0]} rows but token_ids has {T}: lengths disagree"
            )
        if rank == 3 and m.shape[1:] != (meta.num_layers, meta.top_k):
            raise ValueError(
                f"{path}: field {name!r} has shape {m.shape}, expected [T, num_layers={meta.num_layers}, "
                f"top_k={meta.top_k}]"
            )
    if "domain" in members and not meta.domains:
        raise ValueError(f"{path}: field 'domain' is present but meta.domains names no domains")


def open_trace(path: str | os.PathLike, validate: bool = False, chunk_tokens: int = 1 << 16) -> Trace:
    """Open a trace lazily; checks meta, fields, dtypes and shapes (reads no row data).

    With ``validate=True`` also scans every row (streaming) for out-of-range ids and NaN weights.
    Raises ``ValueError`` naming the file and the field.
    """
    path = os.fspath(path)
    meta, members = _inspect_members(path)
    _check_shapes(path, meta, members)
    trace = Trace(path, meta, members)
    if validate:
        _check_values(trace, chunk_tokens)
    return trace


def _check_values(trace: Trace, chunk_tokens: int) -> None:
    """Scan every row of ``trace`` (streamed) for out-of-range ids and bad weights."""
    start = 0
    for ch in trace.iter_chunks(chunk_tokens=chunk_tokens):
        _check_chunk(trace, ch, start)
        start += ch["token_ids"].shape[0]


def _check_chunk(trace: Trace, ch: Mapping[str, np.ndarray], start: int) -> None:
    """Check the value fields present in one chunk of rows starting at token ``start``."""
    meta, path = trace.meta, trace.path

    def bad(name: str, mask: np.ndarray, what: str) -> None:
        i = int(np.flatnonzero(mask.reshape(mask.shape[0], -1).any(axis=1))[0])
        raise ValueError(f"{path}: field {name!r} at token {start + i}: {what}")

    if "token_ids" in ch:
        tok = ch["token_ids"]
        if tok.size and (tok.min() < 0 or tok.max() >= meta.vocab_size):
            bad("token_ids", (tok < 0) | (tok >= meta.vocab_size),
                f"token id out of range [0, vocab_size={meta.vocab_size})")
    if "topk_ids" in ch:
        topk = ch["topk_ids"]
        if topk.size and (topk.min() < 0 or topk.max() >= meta.num_experts):
            bad("topk_ids", (topk < 0) | (topk >= meta.num_experts),
                f"expert id out of range [0, num_experts={meta.num_experts})")
        if topk.shape[-1] > 1:
            srt = np.sort(topk, axis=-1)
            twice = (srt[..., 1:] == srt[..., :-1]).any(axis=-1)
            if twice.any():
                bad("topk_ids", twice, "an expert appears twice in one token's top-k")
    if "positions" in ch:
        pos = ch["positions"]
        if pos.size and pos.min() < 0:
            bad("positions", pos < 0, "negative position")
    if "domain" in ch:
        d = ch["domain"]
        if d.size and (d.min() < 0 or d.max() >= len(meta.domains)):
            bad("domain", (d < 0) | (d >= len(meta.domains)),
                f"domain label out of range [0, len(meta.domains)={len(meta.domains)})")
    if "topk_weights" in ch:
        w = ch["topk_weights"]
        finite = np.isfinite(w)
        if not finite.all():
            bad("topk_weights", ~finite, "NaN or infinite router weight")


SPILL_PREFIX = ".trace-"
SPILL_INDEX = "spill.json"
SPILL_LOCK = "lock"  # flock-ed by the writer for its whole life: the kernel drops it when the writer dies


def _try_lock(spill_dir: str):
    """The spill's lock file, flock-ed exclusively without waiting, or None when its writer (or
    another recoverer) still holds it, or it has no lock file."""
    import fcntl

    try:
        fd = open(os.path.join(spill_dir, SPILL_LOCK), "a")
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fd.close()
        return None
    return fd


def _assemble(path: str, meta: TraceMeta, spill_dir: str, dtypes: Mapping[str, np.dtype],
              tails: Mapping[str, tuple[int, ...]], num_tokens: int, compresslevel: int = 1) -> None:
    """The ``.npz`` at ``path`` from the first ``num_tokens`` rows of each raw spill file,
    written to a temporary name and renamed (readers never see a half-written trace)."""
    from .bounded import refuse_special

    refuse_special(path, "output")  # never a regular file renamed over a device node or FIFO
    tmp = path + ".tmp"
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=compresslevel) as zf:
            for name, dtype in dtypes.items():
                shape = (num_tokens, *tails[name])
                with zf.open(name + ".npy", "w", force_zip64=True) as out:
                    np.lib.format.write_array_header_2_0(
                        out, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
                    )
                    left = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    with open(os.path.join(spill_dir, name), "rb") as src:
                        while left > 0:
                            block = src.read(min(left, 1 << 22))
                            if not block:
                                raise ValueError(f"{spill_dir}: spill file {name!r} ends early")
                            out.write(block)
                            left -= len(block)
            with zf.open("meta.npy", "w") as out:
                np.lib.format.write_array(out, np.array(meta.to_json()), allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


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
        self._dir = tempfile.mkdtemp(prefix=SPILL_PREFIX, dir=parent)
        self._lock = _try_lock(self._dir)  # a fresh directory: always ours
        self._files: dict[str, object] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._tail: dict[str, tuple[int, ...]] = {}
        self.num_tokens = 0
        self._closed = False
        self._broken = False
        self._appends = 0  # successful ones

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
        unknown = set(arrays) - set(_FIELDS)
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
            dtypes, rank = _FIELDS[name]
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
            _assemble(self.path, self.meta, self._dir, self._dtypes, self._tail, self.num_tokens, self.compresslevel)
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


def spill_owner_alive(spill_dir: str) -> bool:
    """Is someone (its writer, or a recoverer) still holding ``spill_dir``? Asked of the lock
    the writer holds while it lives, which the kernel drops when it dies, whatever its pid
    namespace. A directory without a lock file counts as held: only ``--force`` touches it."""
    fd = _try_lock(spill_dir)
    if fd is None:
        return os.path.isdir(spill_dir)
    fd.close()
    return False


def _free_name(path: str) -> str:
    if not os.path.exists(path):
        return path
    stem = path[: -len(".npz")] if path.endswith(".npz") else path
    n = 1
    while os.path.exists(f"{stem}-recovered{'' if n == 1 else f'-{n}'}.npz"):
        n += 1
    return f"{stem}-recovered{'' if n == 1 else f'-{n}'}.npz"


def recover_spill(spill_dir: str, force: bool = False) -> tuple[str | None, int]:
    """Turn the spill directory of a writer that died before ``close`` into its trace.

    Takes the spill's lock first (refused while the writer or another recoverer holds it, unless
    ``force``). Keeps the rows every field holds completely (a kill in the middle of a step
    loses that step only), writes the ``.npz`` the writer would have written (or a free
    ``<name>-recovered[-n].npz`` beside it) and removes the directory. Returns (path or None when
    no row was complete, tokens). Raises ValueError naming the directory when it is held, or its
    index is damaged (the directory is then left alone)."""
    lock = _try_lock(spill_dir)
    if lock is None and not force:
        raise ValueError(f"{spill_dir}: still held by its writer or another recoverer (or has no lock file); "
                         f"--force to recover it anyway")
    try:
        where = os.path.join(spill_dir, SPILL_INDEX)
        if not os.path.exists(where):
            if not any(n not in (SPILL_LOCK, SPILL_INDEX + ".tmp") for n in os.listdir(spill_dir)):
                shutil.rmtree(spill_dir, ignore_errors=True)  # died before its first rows: nothing to keep
                return None, 0
            raise ValueError(f"{spill_dir}: no {SPILL_INDEX}: unrecoverable (not a smoe spill directory?)")
        try:
            with open(where) as f:
                index = json.load(f)
            meta = TraceMeta.from_json(index["meta"], where)
            fields = {n: (np.dtype(np.lib.format.descr_to_dtype(v["dtype"])), tuple(int(x) for x in v["tail"]))
                      for n, v in index["fields"].items()}
            # the output beside the spill: the record directory may have moved since
            path = os.path.join(os.path.dirname(os.path.abspath(spill_dir)), os.path.basename(os.fspath(index["path"])))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: damaged spill index ({e}): unrecoverable") from None
        missing = [n for n in REQUIRED_FIELDS if n not in fields]
        if missing:
            raise ValueError(f"{where}: field(s) {missing} missing: unrecoverable")
        foreign = sorted(n for n in fields if n not in _FIELDS)  # a name is a file in the spill: no paths
        if foreign:
            raise ValueError(f"{where}: field(s) {[short(n) for n in foreign[:3]]} are not fields of the trace format "
                             f"({', '.join(_FIELDS)}): unrecoverable")
        rows = []
        for name, (dtype, tail) in fields.items():
            row_bytes = dtype.itemsize * int(np.prod(tail, dtype=np.int64))
            try:
                rows.append(os.path.getsize(os.path.join(spill_dir, name)) // row_bytes)
            except OSError:
                rows.append(0)
        n = min(rows)
        out = None
        if n > 0:
            out = _free_name(path)
            _assemble(out, meta, spill_dir, {k: d for k, (d, _) in fields.items()},
                      {k: t for k, (_, t) in fields.items()}, n, int(index.get("compresslevel", 1)))
        shutil.rmtree(spill_dir, ignore_errors=True)
        return out, n
    finally:
        if lock is not None:
            lock.close()


def recover_dead_spills(directory: str, wait_s: float = 0.0) -> list[tuple[str, str | None, int, str | None]]:
    """Recover the spill directories in ``directory`` whose writer is gone, waiting up to
    ``wait_s`` for writers still running (e.g. a worker finishing its own close; one that
    closes meanwhile leaves nothing to do). Returns [(spill dir, trace path or None, tokens,
    error or None)]; spills still held are left out."""
    import time

    deadline = time.monotonic() + wait_s
    done = []
    for spill in find_spills(directory):
        while os.path.isdir(spill) and spill_owner_alive(spill) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not os.path.isdir(spill) or spill_owner_alive(spill):
            continue
        try:
            out, n = recover_spill(spill)
            done.append((spill, out, n, None))
        except (ValueError, OSError) as e:  # held again meanwhile, damaged, or a full disk: named, not fatal
            done.append((spill, None, 0, str(e)))
    return done


def find_spills(directory: str) -> list[str]:
    """Spill directories (``.trace-*``) directly inside ``directory``, sorted."""
    try:
        names = os.listdir(directory)
    except OSError as e:
        raise ValueError(f"{directory}: cannot list ({e.strerror})") from None
    return sorted(os.path.join(directory, n) for n in names
                  if n.startswith(SPILL_PREFIX) and os.path.isdir(os.path.join(directory, n)))


def write_trace(path: str | os.PathLike, meta: TraceMeta, **arrays: np.ndarray) -> str:
    """Write a whole in-memory trace (convenience over :class:`TraceWriter`)."""
    with TraceWriter(path, meta) as w:
        w.append(**arrays)
    return os.fspath(path)


def expand_trace_paths(specs: Sequence[str]) -> list[str]:
    """Files named by ``specs``: files as given, directories -> their ``*.npz`` (sorted),
    anything else as a glob pattern. Raises ValueError when a spec matches nothing."""
    return [f for f, _ in _expand(specs)]


def _expand(specs: Sequence[str]) -> list[tuple[str, bool]]:
    """(file, found in a directory) for every file ``specs`` name (:func:`expand_trace_paths`)."""
    import glob

    out: list[tuple[str, bool]] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = sorted(glob.glob(os.path.join(spec, "*.npz")))
            spills = find_spills(spec)
            if spills and not found:
                raise ValueError(f"{spec}: no trace files, but {len(spills)} spill director{'ies' if len(spills) > 1 else 'y'}"
                                 f" of a recorder that did not close its file: run smoe-trace recover {spec}")
            if spills:
                import warnings

                warnings.warn(f"{spec}: {len(spills)} spill director{'ies' if len(spills) > 1 else 'y'} not read "
                              f"(a recorder still writing, or killed: smoe-trace recover {spec})", stacklevel=2)
        elif os.path.exists(spec):
            found = [spec]
        else:
            found = sorted(glob.glob(spec))
        if not found:
            raise ValueError(f"{spec}: no trace files found (a file, a directory of .npz, or a glob)")
        out.extend((f, os.path.isdir(spec)) for f in found)
    return out


def open_traces(specs: Sequence[str]) -> tuple[TraceMeta, list[Trace]]:
    """Open the traces named by ``specs`` (see :func:`expand_trace_paths`) lazily and check that
    they agree on num_layers, num_experts, top_k and vocab_size. Returns (meta of the first, traces).
    A file found in a directory (a recording) that does not open as a trace is skipped with a
    warning naming it; a file named as such is refused (ValueError)."""
    import warnings

    traces = []
    for path, in_dir in _expand(specs):
        try:
            traces.append(open_trace(path))
        except ValueError as e:
            if not in_dir:
                raise
            warnings.warn(f"skipped {path}: {e}", stacklevel=2)
    if not traces:
        raise ValueError(f"{', '.join(specs)}: no readable trace file (each was skipped, see the warnings)")
    m0 = traces[0].meta
    for t in traces[1:]:
        for key in ("num_layers", "num_experts", "top_k", "vocab_size"):
            if getattr(t.meta, key) != getattr(m0, key):
                raise ValueError(f"{t.path}: field 'meta.{key}' = {getattr(t.meta, key)} differs from "
                                 f"{traces[0].path} ({getattr(m0, key)})")
    return m0, traces


_VALUE_FIELDS = ("token_ids", "topk_ids", "positions", "domain", "topk_weights")


def iter_traces(traces: Sequence[Trace], fields: Sequence[str] = ("token_ids", "request_ids", "positions",
                                                                   "topk_ids", "step_ids", "is_prefill"),
                chunk_tokens: int = 1 << 16, validate: bool = True,
                check: Sequence[str] = ("token_ids", "topk_ids", "positions", "domain")
                ) -> Iterator[dict[str, np.ndarray]]:
    """Stream the rows of ``traces`` in order as ``{field: [n, ...]}`` chunks of at most
    ``chunk_tokens`` rows; an optional field is yielded only when every trace has it.

    request_ids and step_ids are offset per recording (files whose meta has the same ``recording``
    id, e.g. the rotated chunks of one server, share them) so that separate recordings stay
    distinct. With ``validate``, the ``check`` fields a trace has (read for it when not asked for)
    and any value field asked for are checked as they pass (ids in range, no expert twice in a
    top-k, positions, domains, finite weights); errors name the file, field and token.
    """
    present = [f for f in fields if all(t.has(f) for t in traces)]
    offsets: dict[str, tuple[int, int]] = {}
    next_req = next_step = 0
    for t in traces:
        group = str(t.meta.extra.get("recording", t.path))
        if group not in offsets:
            offsets[group] = (next_req, next_step)
        req_off, step_off = offsets[group]
        read = present + [f for f in check if validate and t.has(f) and f not in present]
        start = 0
        for ch in t.iter_chunks(read, chunk_tokens):
            if validate:
                _check_chunk(t, {f: ch[f] for f in _VALUE_FIELDS if f in ch}, start)
            start += ch["token_ids"].shape[0] if "token_ids" in ch else 0
            out = {}
            for f in present:
                a = ch[f]
                if f == "request_ids":
                    a = a.astype(np.int64) + req_off
                    next_req = max(next_req, int(a.max()) + 1) if a.size else next_req
                elif f == "step_ids":
                    a = a.astype(np.int64) + step_off
                    next_step = max(next_step, int(a.max()) + 1) if a.size else next_step
                out[f] = a
            yield out


def read_traces(specs: Sequence[str], fields: Sequence[str] = ("token_ids", "request_ids", "positions", "topk_ids",
                                                               "step_ids", "is_prefill"),
                validate: bool = True) -> tuple[TraceMeta, dict[str, np.ndarray], list[str]]:
    """Concatenate the traces named by ``specs`` in memory (:func:`iter_traces` streams them).
    Returns (meta of the first file, {field: array}, file list)."""
    meta, traces = open_traces(specs)
    chunks = list(iter_traces(traces, fields, chunk_tokens=1 << 18, validate=validate, check=_VALUE_FIELDS))
    present = [f for f in fields if all(t.has(f) for t in traces)]
    if not chunks:  # no rows: empty arrays of each field's own dtype and row shape
        chunks = [{f: traces[0].load(f) for f in present}]
    out = {f: np.concatenate([c[f] for c in chunks]) for f in present}
    return meta, out, [t.path for t in traces]


def summary(trace: Trace) -> dict[str, object]:
    m = trace.meta
    return {
        "path": trace.path,
        "tokens": trace.num_tokens,
        "fields": list(trace.fields),
        "num_layers": m.num_layers,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "vocab_size": m.vocab_size,
        "domains": list(m.domains),
        "model": m.model,
    }
