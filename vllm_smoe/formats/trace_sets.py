"""Several routing traces read as one: the files a list of paths, directories and globs names,
opened together (their meta must agree) and streamed or concatenated row by row."""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from .trace_checks import VALUE_FIELDS, check_chunk
from .trace_meta import TraceMeta
from .trace_reader import Trace, open_trace
from .trace_spill import find_spills


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
                check_chunk(t, {f: ch[f] for f in VALUE_FIELDS if f in ch}, start)
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
    chunks = list(iter_traces(traces, fields, chunk_tokens=1 << 18, validate=validate, check=VALUE_FIELDS))
    present = [f for f in fields if all(t.has(f) for t in traces)]
    if not chunks:  # no rows: empty arrays of each field's own dtype and row shape
        chunks = [{f: traces[0].load(f) for f in present}]
    out = {f: np.concatenate([c[f] for c in chunks]) for f in present}
    return meta, out, [t.path for t in traces]
