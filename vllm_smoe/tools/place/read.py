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

# the largest vocabulary smoe-place builds tables for: [V] arrays per layer, several bytes an id (real
# vocabularies are below 2^18; a larger meta.vocab_size is a broken or hostile header, not a model)
MAX_VOCAB = 1 << 26
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
    if meta.vocab_size > MAX_VOCAB:
        raise ValueError(f"{files[0]}: field 'meta.vocab_size' = {meta.vocab_size}: smoe-place builds tables for "
                         f"at most {MAX_VOCAB} token ids")
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


def model_info(model_dir: str | None, vocab_size: int, meta=None):
    """(fingerprint, embeddings [V, H] or None, routing groups) from a checkpoint directory; with
    ``meta`` (the trace's), the checkpoint must be the recorded model's shape (MoE layers,
    experts, top-k, a vocabulary holding the trace's ids): its fingerprint goes into the YAML."""
    if model_dir is None:
        return None, None, 1
    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{model_dir}: no config.json (--model must be a checkpoint directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if meta is not None:
        _check_model(cfg_path, cfg, meta)
    emb = read_embeddings(model_dir, vocab_size)
    bad = ~np.isfinite(emb).all(axis=1)
    if bad.any():
        raise ValueError(f"{model_dir}: tensor '*embed_tokens.weight' holds non-finite values in {int(bad.sum())} "
                         f"rows (first: token id {int(np.argmax(bad))})")
    return model_fingerprint(cfg), emb, expert_groups(cfg)


def _check_model(cfg_path: str, cfg: dict, meta) -> None:
    """The checkpoint's config against the recording's meta, naming the first field that differs."""
    from ...formats.model_info import moe_layer_indices, num_experts, text_config, top_k

    try:
        got = {"num_layers": len(moe_layer_indices(cfg)), "num_experts": num_experts(cfg), "top_k": top_k(cfg)}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{cfg_path}: not a MoE model smoe knows ({type(e).__name__}: {e})") from None
    for key, value in got.items():
        if value != getattr(meta, key):
            raise ValueError(f"{cfg_path}: the checkpoint has {key} {value} but the trace was recorded from a model "
                             f"with meta.{key} = {getattr(meta, key)}: --model must be the recorded model")
    tc = text_config(cfg)
    vocab = tc.get("vocab_size") if isinstance(tc, dict) else None
    if isinstance(vocab, int) and vocab < meta.vocab_size:
        raise ValueError(f"{cfg_path}: the checkpoint's vocab_size {vocab} is smaller than the trace's "
                         f"meta.vocab_size {meta.vocab_size}: --model must be the recorded model")


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
