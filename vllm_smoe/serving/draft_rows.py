"""Recording under speculative decoding: only the rows of tokens that stay in their request.

With ``--speculative-config`` each step of a decoding request runs its last token and the k draft
tokens proposed for it (``SchedulerOutput.scheduled_spec_decode_tokens``, the last k rows of the
request in the step). The target routes all of them, but drafts that sampling rejects never
become part of the sequence: a later step runs other tokens at their positions. A trace holds
each (request, position) once, the token that was kept, so a draft's row is held back until its
request's next step shows which were kept: the next step starts at the first position not kept
(vLLM's scheduler rewinds ``num_computed_tokens`` past rejected drafts), so held rows before that
position are written and the rest are dropped as rejected. The drafts of a request's last step
are never confirmed (the worker never learns how many were kept) and are left out: at most k rows
per request, counted. Runs on the recorder's writer thread; host arrays only.
"""

from __future__ import annotations

import threading

import numpy as np


def draft_counts(scheduler_output, req_ids: list[str]) -> np.ndarray:
    """[R] int64: how many of each request's rows in this step are draft tokens."""
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    return np.array([len(spec.get(r, ())) for r in req_ids], dtype=np.int64)


def draft_mask(counts: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """[sum(counts)] bool: the rows that are drafts, the last ``drafts[i]`` of request i's ``counts[i]``."""
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    within = np.arange(int(counts.sum())) - np.repeat(starts, counts)
    return within >= np.repeat(counts - np.asarray(drafts, dtype=np.int64), counts)


def _take(fields: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[rows] for k, v in fields.items()}


class DraftRows:
    """Draft rows held per trace request id until a later step of the request settles them. The
    step's thread notes each queued step's draft counts and the requests that finished; the
    writer thread settles the steps in order (a step dropped before the writer saw it passes its
    finished requests on to the next)."""

    def __init__(self):
        self.held: dict[int, dict[str, np.ndarray]] = {}
        self.rejected = 0  # rows of drafts sampling rejected (not in the trace, rightly)
        self.unconfirmed = 0  # rows of drafts in a request's last step (left out: kept or not unknown)
        self._ended: list[int] = []  # step thread: trace ids finished since the last note
        self._notes: dict[int, tuple[np.ndarray, list[int]]] = {}  # step id -> (draft counts, finished before it)
        self._lock = threading.Lock()
        self._told = False

    def finished(self, trace_id: int | None) -> None:
        """Step thread: a request left the batch (None: one this recorder never wrote)."""
        if trace_id is not None:
            self._ended.append(trace_id)

    def note(self, step: int, drafts: np.ndarray) -> None:
        """Step thread, before step ``step`` is queued: its draft rows per request."""
        with self._lock:
            self._notes[step] = (drafts, self._ended)
            self._ended = []

    def settle(self, step: int, fields: dict[str, np.ndarray], counts: np.ndarray, rows: np.ndarray
               ) -> dict[str, np.ndarray]:
        """Writer thread. ``fields``: step ``step``'s rows to write (``request_ids`` and
        ``positions`` among them), ``rows``: which of the step's rows (per ``counts``) they are.
        Returns what to write now: earlier drafts this step shows were kept, then this step's
        rows that are not drafts. This step's drafts are held."""
        with self._lock:
            mine = sorted(s for s in self._notes if s <= step)
            notes = [self._notes.pop(s) for s in mine]
        drafts = notes[-1][0] if mine and mine[-1] == step else np.zeros(len(counts), dtype=np.int64)
        draft = draft_mask(counts, drafts)[rows]
        req, pos = fields["request_ids"], fields["positions"]
        out = []
        for r in np.unique(req):
            held = self.held.pop(int(r), None)
            if held is not None:
                kept = held["positions"] < pos[req == r].min()
                self.rejected += int((~kept).sum())
                out.append(_take(held, kept))
        out.append(_take(fields, ~draft))
        for r in np.unique(req[draft]):
            self.held[int(r)] = _take(fields, draft & (req == r))
        for _, ended in notes:
            for r in ended:
                self.unconfirmed += len(self.held.pop(int(r), {}).get("positions", ()))
        return {k: np.concatenate([o[k] for o in out]) for k in fields}

    def close(self) -> str | None:
        """At the recorder's close: every held row is left out (counted as unconfirmed). The
        summary line to log, once, where drafts were seen."""
        self.unconfirmed += sum(len(h["positions"]) for h in self.held.values())
        self.held.clear()
        if self._told or not (self.rejected or self.unconfirmed):
            return None
        self._told = True
        return (f"smoe record: speculative decoding: {self.rejected} rows of drafts sampling rejected and "
                f"{self.unconfirmed} of drafts in requests' last steps (kept or not, unknown here) are not in the trace")
