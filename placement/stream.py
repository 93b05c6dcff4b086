"""One pass over a trace's rows, chunk by chunk: the routing counts of every token and the rows
of the spans a placement is learned or judged on, then those rows in engine-step order.

A chunk is a dict {field: array} of consecutive trace rows: token_ids [n] int, topk_ids
[n, L, K] int (-1 = no expert), and any of request_ids, positions, step_ids [n] int,
is_prefill [n] bool, domain [n] int. The caller reads the files and hands the chunks over.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from .assign import batches_from_windows
from .routing_counts import RoutingCounts


def token_occurrences(token_ids: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """[vocab_size] int64 how often each id occurs in the chunks of token ids ([n] int each);
    ids outside 0..vocab_size - 1 are not counted."""
    occ = np.zeros(vocab_size, dtype=np.int64)
    for tok in token_ids:
        occ += np.bincount(tok[(tok >= 0) & (tok < vocab_size)], minlength=vocab_size)
    return occ


def stream_rows(chunks: Iterable[Mapping[str, np.ndarray]], spans: list[tuple[int, int]],
                counts: RoutingCounts | None = None, file_ends: np.ndarray | None = None,
                engine_of_file: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Adds every chunk's routing to ``counts`` (when given) and keeps the rows inside ``spans``
    ([start, stop) over all chunks' rows, sorted and disjoint). With ``file_ends`` ([files]
    int64, the row past each file's last) and ``engine_of_file`` ([files] int64), the kept rows
    also get ``engine`` [n] int64: the DP engine that recorded each. Returns {field: [n, ...]},
    the kept rows in trace order ({} when none)."""
    parts, start = [], 0
    for ch in chunks:
        n = ch["token_ids"].shape[0]
        if counts is not None:
            counts.add(ch["token_ids"], ch["topk_ids"])
        for lo, hi in spans:
            a, b = max(lo - start, 0), min(hi - start, n)
            if a < b:
                parts.append({k: v[a:b].copy() for k, v in ch.items()})
                if engine_of_file is not None:
                    parts[-1]["engine"] = engine_of_file[np.searchsorted(file_ends, np.arange(start + a, start + b),
                                                                         side="right")]
        start += n
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else {}


def by_step(rows: dict[str, np.ndarray], batch_tokens: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Rows sorted by engine step, and their batch ids [n] int (the step_ids where the rows have
    them, else windows of ``batch_tokens`` rows)."""
    if "step_ids" in rows:
        order = np.argsort(rows["step_ids"], kind="stable")
        if (order != np.arange(order.size)).any():
            rows = {k: v[order] for k, v in rows.items()}
        return rows, rows["step_ids"]
    return rows, batches_from_windows(rows["token_ids"].size, batch_tokens)


def polish_rows(rows: dict[str, np.ndarray], batch: np.ndarray, tokens: int
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """place_model's ``rows``: (topk_ids [t, L, K], batch ids [t]) of the first ``tokens`` rows
    (sorted by step) of ``rows``, or None (``tokens`` 0, or no rows)."""
    if not tokens or not rows or rows["topk_ids"].shape[0] == 0:
        return None
    return rows["topk_ids"][:tokens], np.asarray(batch)[:tokens]
