"""Checks of a routing trace against its meta: the fields' dtypes and shapes (from the headers
alone) and the values of their rows (ids in range, finite weights), chunk by chunk."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .trace_meta import FIELD2SPEC, REQUIRED_FIELDS, TraceMeta

# ``trace`` / ``members`` below are trace_reader's Trace and {field: Member}, not imported here:
# trace_reader imports this module, and these checks read only the attributes they use

# the fields whose rows check_chunk checks
VALUE_FIELDS = ("token_ids", "topk_ids", "positions", "request_ids", "step_ids", "domain", "topk_weights")


def check_shapes(path: str, meta: TraceMeta, members: dict) -> None:
    """Check the fields' presence, dtypes and shapes against ``meta`` from their headers alone."""
    for name in REQUIRED_FIELDS:
        if name not in members:
            raise ValueError(f"{path}: missing required field {name!r}")
    T = members["token_ids"].shape[0] if members["token_ids"].shape else None
    for name, m in members.items():
        if name not in FIELD2SPEC:
            continue  # unknown extra arrays are allowed and ignored
        dtypes, rank = FIELD2SPEC[name]
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


def check_values(trace, chunk_tokens: int) -> None:
    """Scan every row of ``trace`` (streamed) for out-of-range ids and bad weights."""
    start = 0
    for ch in trace.iter_chunks(chunk_tokens=chunk_tokens):
        check_chunk(trace, ch, start)
        start += ch["token_ids"].shape[0]


def check_chunk(trace, ch: Mapping[str, np.ndarray], start: int) -> None:
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
    # the recorder writes request ordinals and vLLM's step counter, both counted up from 0
    for name, what in (("positions", "position"), ("request_ids", "request id"), ("step_ids", "step id")):
        if name in ch:
            a = ch[name]
            if a.size and a.min() < 0:
                bad(name, a < 0, f"negative {what}")
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
