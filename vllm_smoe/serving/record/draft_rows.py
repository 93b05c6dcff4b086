"""Recording under speculative decoding: only the rows of tokens that stay in their request.

With ``--speculative-config`` each step of a decoding request runs its last token and the k draft
tokens proposed for it (``SchedulerOutput.scheduled_spec_decode_tokens``, the last k rows of the
request in the step). The target routes all of them, but drafts that sampling rejects never
become part of the sequence: a later step runs other tokens at their positions. A trace holds
each (request, position) once, the token that was kept, so a draft's row is held back until its
request's next step shows which were kept: the next step starts at the first position not kept
(vLLM's scheduler rewinds ``num_computed_tokens`` past rejected drafts), so held rows before that
position are written and the rest are dropped as rejected. Rows no step can judge are left out
and counted (:class:`DraftRows`); a vLLM whose scheduler output names no drafts gets none of its
speculating steps written (:func:`draft_counts`). Runs on the recorder's writer thread; host
arrays only."""

from __future__ import annotations

import threading

import numpy as np


def draft_counts(scheduler_output, req_ids: list[str], speculative: bool) -> np.ndarray | None:
    """[R] int64: how many of each request's rows in this step are draft tokens. None where
    ``speculative`` (a speculative config is set) but the scheduler output lacks
    ``scheduled_spec_decode_tokens`` (a vLLM that renamed it): which rows are drafts is unknown
    (never taken as none), so the recorder writes none of those steps."""
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None)
    if spec is None:
        if speculative:
            return None
        spec = {}
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
    """Draft rows held per trace request id until the request's next step settles them. The
    step's thread notes each step it numbers (its draft counts, its requests' trace ids and the
    requests that finished before it); the writer thread settles the written steps in order. A
    noted step the writer never settled was dropped (unrecordable, the queue full, a layer without
    its rows, a failed write): its finished requests are passed on to the next, and the drafts
    held for its requests are left out and counted, never judged by a later step.

    Only the request's very next step can judge them: where that step was not written
    (unrecordable, the writer behind, a layer that wrote no rows for it), a later step starts past
    tokens kept since, so the held rows are left out and counted instead. The drafts of a request's
    last step are never confirmed either (the worker never learns how many were kept) and are left
    out: at most k rows per request, counted."""

    def __init__(self):
        self.held: dict[int, dict[str, np.ndarray]] = {}
        self.rejected = 0  # rows of drafts sampling rejected (not in the trace, rightly)
        # rows of drafts left out, kept or not unknown: a request's last step, or its next step dropped
        self.unconfirmed = 0
        self._ended: list[int] = []  # step thread: trace ids finished since the last note
        # step id -> (draft counts, trace ids of its requests (-1: not recorded), finished before it)
        self._notes: dict[int, tuple[np.ndarray, np.ndarray, list[int]]] = {}
        self._lock = threading.Lock()  # _notes: the step thread and the writer
        self._held_lock = threading.Lock()  # held and the counts: the writer's settle and close
        self._told = False

    def finished(self, trace_id: int | None) -> None:
        """Step thread: a request left the batch (None: one this recorder never wrote)."""
        if trace_id is not None:
            self._ended.append(trace_id)

    def note(self, step: int, drafts: np.ndarray, requests: np.ndarray) -> None:
        """Step thread, for every step numbered ``step`` (before it is queued): its draft rows
        per request and its requests' trace ids (-1: a request not recorded)."""
        with self._lock:
            self._notes[step] = (drafts, np.asarray(requests, dtype=np.int64), self._ended)
            self._ended = []

    def drop(self, step: int, requests: np.ndarray) -> None:
        """Step thread: step ``step`` is not queued at all (unrecordable); ``requests`` as for
        :meth:`note`. Equal to a note the writer never settles (what a step dropped later is)."""
        self.note(step, np.zeros(len(requests), dtype=np.int64), requests)

    def _leave_out(self, trace_id: int) -> None:
        """Under _held_lock: the request's held drafts, kept or not unknown, are left out."""
        held = self.held.pop(int(trace_id), None)
        if held is not None:
            self.unconfirmed += len(held["positions"])

    def settle(self, step: int, fields: dict[str, np.ndarray], counts: np.ndarray, rows: np.ndarray
               ) -> dict[str, np.ndarray]:
        """Writer thread. ``fields``: step ``step``'s rows to write (``request_ids`` and
        ``positions`` among them), ``rows``: which of the step's rows (per ``counts``) they are.
        Returns what to write now: earlier drafts this step shows were kept, then this step's
        rows that are not drafts. This step's drafts are held."""
        with self._lock:
            mine = sorted(s for s in self._notes if s <= step)
            notes = {s: self._notes.pop(s) for s in mine}
        with self._held_lock:
            for s, (_, requests, _) in notes.items():
                if s != step:  # dropped: its requests' held drafts were judged by no step
                    for r in requests[requests >= 0]:
                        self._leave_out(r)
            drafts = notes[step][0] if step in notes else np.zeros(len(counts), dtype=np.int64)
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
            for _, _, ended in notes.values():
                for r in ended:
                    self._leave_out(r)
        return {k: np.concatenate([o[k] for o in out]) for k in fields}

    def close(self) -> str | None:
        """At the recorder's close: every held row is left out (counted as unconfirmed). The
        summary line to log, once, where drafts were seen. Safe beside a settle still running
        (a drain that timed out): both hold _held_lock."""
        with self._held_lock:
            for r in list(self.held):
                self._leave_out(r)
            if self._told or not (self.rejected or self.unconfirmed):
                return None
            self._told = True
            return (f"smoe record: speculative decoding: {self.rejected} rows of drafts sampling rejected and "
                    f"{self.unconfirmed} of drafts whose request ended or whose next step was not recorded (kept "
                    f"or not, unknown here) are not in the trace")
