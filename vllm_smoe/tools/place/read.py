"""What ``smoe-place`` reads: the traces (one pass, with progress bars, handing their chunks to
placement/stream.py), the checkpoint's config and embeddings, and a placement's training traces."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

from ...formats.checkpoint import read_embeddings
from ...formats.model_info import expert_groups
from ...formats.placement_file import model_fingerprint
from ...formats.trace import iter_traces, open_traces
from ...placement.routing_counts import RoutingCounts
from ...placement.stream import stream_rows, token_occurrences
from ..parallel import prefetch

SAMPLE_FIELDS = ("token_ids", "request_ids", "positions", "topk_ids", "step_ids", "is_prefill", "domain")


def bar(desc: str, total: int, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "tok", leave=False, file=sys.stderr,
                mininterval=1.0)


def _ticking(chunks, progress, field: str | None = None):
    """``chunks``, each counted on the ``progress`` bar (by its rows) once it is used; with
    ``field``, that array of each chunk instead of the chunk."""
    for ch in chunks:
        yield ch if field is None else ch[field]
        progress.update(ch["token_ids"].shape[0])


def engine(trace) -> int:
    """The DP engine that recorded ``trace``: its meta's ``dp_rank``, else the recorder's file name
    (``trace-dp<rank>-...``), else 0."""
    if "dp_rank" in trace.meta.extra:
        return int(trace.meta.extra["dp_rank"])
    m = re.match(r"trace-dp(\d+)-", os.path.basename(trace.path))
    return int(m.group(1)) if m else 0


def stream(specs, windows=None, counts: bool = True, desc: str = "counting", sample_tokens: int = 0,
           engines: bool = False):
    """One pass over the traces: routing counts of every token (when ``counts``) and the rows
    inside ``windows`` (a function of the total token count -> [start, stop) ranges) as arrays;
    the counts keep the first ``sample_tokens`` rows whole (for the bytes objective). With
    ``engines``, the rows also get ``engine`` [n] int64: the DP engine that recorded each
    (:func:`engine`), whose recordings ran side by side where one engine's follow each other.
    Returns (meta, RoutingCounts or None, {field: rows} in trace order, the files read, total rows)."""
    meta, traces = open_traces(specs)
    files = [t.path for t in traces]
    total = sum(t.num_tokens for t in traces)
    ends = np.cumsum([t.num_tokens for t in traces])  # [files]: the row past each file's last
    engine_of_file = np.array([engine(t) for t in traces], dtype=np.int64)
    if total == 0:
        raise ValueError(f"{', '.join(files)}: the trace holds no tokens")
    if counts and total >= 2**32:
        raise ValueError(f"{', '.join(files[:3])}{' ...' if len(files) > 3 else ''}: {total} tokens; smoe-place counts "
                         f"at most {2**32 - 1} (pass a sample of the recording)")
    rc = None
    if counts:  # a pass over the small token_ids column first: every id's counts start in their final form
        with bar("scanning token ids", total, "tok") as b:
            chunks = iter_traces(traces, ("token_ids",), chunk_tokens=1 << 20, validate=False)
            occ = token_occurrences(_ticking(chunks, b, "token_ids"), meta.vocab_size)
        rc = RoutingCounts(meta.num_layers, meta.num_experts, meta.top_k, meta.vocab_size, occurrences=occ,
                           sample_tokens=sample_tokens)
    wins = windows(total) if windows else []
    with bar(desc, total, "tok") as b:
        sample = stream_rows(_ticking(prefetch(iter_traces(traces, SAMPLE_FIELDS)), b), wins, rc,
                             *((ends, engine_of_file) if engines else ()))
    return meta, rc, sample, files, total


def model_info(model_dir: str | None, vocab_size: int):
    """(fingerprint, embeddings [V, H] or None, routing groups) from a checkpoint directory."""
    if model_dir is None:
        return None, None, 1
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{model_dir}: no config.json (--model must be a checkpoint directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    return model_fingerprint(cfg), read_embeddings(model_dir, vocab_size), expert_groups(cfg)


def rel(path: str, yaml_path: str) -> str:
    """Trace path as stored in the YAML: relative to the YAML's directory."""
    return os.path.relpath(os.path.abspath(path), os.path.dirname(os.path.abspath(yaml_path)))


def load_train_specs(placement_path: str) -> list[str]:
    from ...formats.bounded import load_yaml

    doc = load_yaml(placement_path, "placement file")
    traces = (doc.get("built_from") or {}).get("traces") if isinstance(doc, dict) else None
    if not traces:
        raise ValueError(f"{placement_path}: field 'built_from.traces' is empty; pass --train")
    base = os.path.dirname(os.path.abspath(placement_path))
    return [os.path.join(base, t) for t in traces]
