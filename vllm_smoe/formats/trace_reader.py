"""Reading one routing trace lazily: :func:`open_trace` reads only the zip directory, the
``.npy`` headers and the small ``meta``; :meth:`Trace.iter_chunks` streams rows from the
compressed members, so traces larger than memory can be validated and scanned."""

from __future__ import annotations

import contextlib
import math
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .bounded import regular_file, short
from .trace_checks import check_shapes, check_values
from .trace_meta import MAX_META_CHARS, OPTIONAL_FIELDS, REQUIRED_FIELDS, TraceMeta


@dataclass(frozen=True)
class Member:
    """One ``.npy`` member's header, as read from the zip: ``name`` is its file name in the zip,
    ``row_bytes`` the bytes of one row (shape[1:] x itemsize; 0 for a 0-d array)."""

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
    """A routing trace on disk, opened lazily. Use :func:`open_trace`.

    One ``.npz`` (zip of ``.npy`` members, as ``numpy.savez_compressed`` writes), one row per token
    the model processed. T = tokens, L = MoE layers, K = top-k.

    =============== ======================== =====================================================
    field           shape, dtype             meaning
    =============== ======================== =====================================================
    token_ids       [T] int32                input token id, 0 <= id < vocab_size
    request_ids     [T] int32                request the token belongs to, >= 0
    positions       [T] int32                position inside its request, >= 0
    topk_ids        [T, L, K] int16|int32    logical expert ids chosen at each MoE layer
    meta            0-d str (JSON, <= 2^20   num_experts, top_k, num_layers, vocab_size (required);
                    chars)                   domains, model, hidden_size (optional); the
                                             recorder adds dp_rank and, speculating,
                                             token_order ("layer" | "step": one order
                                             per MoE layer or per engine step)
    step_ids        [T] int32 (optional)     engine step (= batch) the token was scheduled in, >= 0
    is_prefill      [T] bool (optional)      True for prompt tokens, False for decoded ones
    domain          [T] int (optional)       index into meta["domains"]
    topk_weights    [T, L, K] float16|32     router weights of topk_ids (optional), finite
    =============== ======================== ====================================================="""

    def __init__(self, path: str, meta: TraceMeta, members: dict[str, Member]):
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


# deflate expands a byte to at most 1032 (its longest match, 258 bytes, coded in 2 bits)
_DEFLATE_MAX_RATIO = 1032


def _check_member_size(path: str, name: str, info: zipfile.ZipInfo) -> None:
    """The size the zip directory declares for a member against the bytes it really has: stored
    members hold exactly their size, deflated ones at most 1032 times their compressed bytes."""
    real = info.compress_size
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != real:
        raise ValueError(f"{path}: field {short(name)}: the zip declares {info.file_size} bytes but the member "
                         f"stores {real}")
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > _DEFLATE_MAX_RATIO * real + 1024:
        raise ValueError(f"{path}: field {short(name)}: the zip declares {info.file_size} bytes, more than its "
                         f"{real} compressed bytes can hold")


def _inspect_members(path: str) -> tuple[TraceMeta, dict[str, Member]]:
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
        members: dict[str, Member] = {}
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
                claimed = math.prod(shape) * dtype.itemsize  # Python ints: a forged shape cannot wrap to 0
                if claimed > info.file_size:  # before anything is allocated for it
                    raise ValueError(f"{path}: field {short(name)}: its header claims {claimed} bytes but the member "
                                     f"holds {info.file_size}")
                _check_member_size(path, name, info)
                if name == "meta":
                    if shape != () or dtype.kind != "U":
                        raise ValueError(
                            f"{path}: field 'meta' must be a 0-d string array holding JSON, "
                            f"got shape {shape} dtype {dtype}"
                        )
                    chars = dtype.itemsize // 4
                    if chars > MAX_META_CHARS:  # before a byte of it is read
                        raise ValueError(f"{path}: field 'meta': its header claims a string of {chars} characters, "
                                         f"over the {MAX_META_CHARS} smoe reads")
                    meta_text = str(np.frombuffer(fp.read(dtype.itemsize), dtype=dtype)[0])
                    continue
            if dtype.hasobject:
                raise ValueError(f"{path}: field {name!r} has object dtype; not allowed")
            row = math.prod(shape[1:]) * dtype.itemsize if shape else 0
            members[name] = Member(info.filename, tuple(shape), dtype, fortran, row)
    if meta_text is None:
        raise ValueError(f"{path}: missing required field 'meta'")
    meta = TraceMeta.from_json(meta_text, where=path)
    return meta, members


def open_trace(path: str | os.PathLike, validate: bool = False, chunk_tokens: int = 1 << 16) -> Trace:
    """Open a trace lazily; checks meta, fields, dtypes and shapes (reads no row data).

    With ``validate=True`` also scans every row (streaming) for out-of-range ids and NaN weights.
    Raises ``ValueError`` naming the file and the field.
    """
    path = os.fspath(path)
    meta, members = _inspect_members(path)
    check_shapes(path, meta, members)
    trace = Trace(path, meta, members)
    if validate:
        check_values(trace, chunk_tokens)
    return trace


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
