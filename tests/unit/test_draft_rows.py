"""Recording under speculative decoding: a draft token's row waits for its request's next step;
rejected drafts' rows never reach the trace, nor drafts whose request's next step was dropped
(:mod:`vllm_smoe.serving.record.draft_rows`)."""

import threading
import types

import numpy as np
import pytest

from vllm_smoe.serving.record import draft_rows
from vllm_smoe.serving.record.draft_rows import DraftRows, draft_counts, draft_mask


def test_draft_mask_is_the_last_drafts_of_each_request():
    got = draft_mask(np.array([3, 1, 4]), np.array([2, 0, 1]))
    assert got.tolist() == [False, True, True, False, False, False, False, True]


def _step(rows, req_ids=None):
    """One step's fields from (request, position, token) rows, in order."""
    req, pos, tok = (np.array(c) for c in zip(*rows))
    return {"token_ids": tok.astype(np.int32), "request_ids": req.astype(np.int32), "positions": pos.astype(np.int32),
            "topk_ids": np.stack([tok, tok], 1)[:, None].astype(np.int16), "step_ids": np.zeros(len(rows), np.int32),
            "is_prefill": np.zeros(len(rows), bool)}


def _requests(rows, counts):
    """Each request's trace id, in the step's order."""
    return np.array([rows[i][0] for i in np.cumsum(counts) - counts])


def _run(d, step, rows, counts, drafts, finished=()):
    for r in finished:
        d.finished(r)
    d.note(step, np.array(drafts), _requests(rows, counts))
    fields = _step(rows)
    return d.settle(step, fields, np.array(counts), np.ones(len(rows), bool))


def test_draft_rows_wait_for_their_requests_next_step():
    """Request 0: a prompt of 3; token 10 with drafts 11, 12 of which 11 is kept (the next step
    starts at position 5); then 13 with drafts 14, 15, both rejected; then it ends with drafts
    held. Request 1 decodes without drafts throughout."""
    d = DraftRows()
    out = [_run(d, 0, [(0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 7, 70)], [3, 1], [0, 0])]
    out.append(_run(d, 1, [(0, 3, 10), (0, 4, 11), (0, 5, 12), (1, 8, 71)], [3, 1], [2, 0]))
    out.append(_run(d, 2, [(0, 5, 13), (0, 6, 14), (0, 7, 15), (1, 9, 72)], [3, 1], [2, 0]))
    out.append(_run(d, 3, [(0, 6, 16), (0, 7, 17), (0, 8, 18), (1, 10, 73)], [3, 1], [2, 0]))
    out.append(_run(d, 4, [(1, 11, 74)], [1], [0], finished=[0]))
    pos = np.concatenate([o["positions"][o["request_ids"] == 0] for o in out])
    tok = np.concatenate([o["token_ids"][o["request_ids"] == 0] for o in out])
    assert pos.tolist() == [0, 1, 2, 3, 4, 5, 6] and tok.tolist() == [1, 2, 3, 10, 11, 13, 16]
    assert np.concatenate([o["positions"][o["request_ids"] == 1] for o in out]).tolist() == [7, 8, 9, 10, 11]
    assert (d.rejected, d.unconfirmed, d.held) == (1 + 2, 2, {})
    for o in out:  # every field kept row for row
        assert (o["topk_ids"][:, 0, 0] == o["token_ids"]).all()


def test_a_step_the_writer_never_saw_passes_its_finished_requests_on():
    d = DraftRows()
    _run(d, 0, [(0, 3, 10), (0, 4, 11)], [2], [1])
    d.finished(0)
    d.note(1, np.array([0]), np.array([1]))  # step 1 dropped (the writer fell behind): never settled
    out = _run(d, 2, [(1, 0, 5)], [1], [0])
    assert out["request_ids"].tolist() == [1] and d.unconfirmed == 1 and d.held == {}
    _run(d, 3, [(1, 1, 6), (1, 2, 7)], [2], [1])
    assert "0 rows of drafts sampling rejected and 2 of drafts" in d.close() and d.close() is None  # said once


def test_without_drafts_every_row_is_written_at_once():
    d = DraftRows()
    rows = [(0, 0, 1), (0, 1, 2), (1, 0, 3)]
    out = _run(d, 0, rows, [2, 1], [0, 0])
    for k, v in _step(rows).items():
        np.testing.assert_array_equal(out[k], v)
    assert d.held == {} and (d.rejected, d.unconfirmed) == (0, 0) and d.close() is None


@pytest.mark.parametrize("how", ["never settled", "drop"])
def test_drafts_whose_next_step_was_dropped_are_left_out_not_kept(how):
    """The reviewer's case: step 0 holds request 0's drafts at positions 4 and 5; step 1 (which
    started at 5: 4 kept, 5 rejected) is dropped; step 2 starts at 8. Judged by step 2, both
    looked kept. Kept or not is unknown: both are left out, counted. Request 1, in step 1 too
    but holding nothing, is written on."""
    d = DraftRows()
    out = [_run(d, 0, [(0, 3, 10), (0, 4, 11), (0, 5, 12), (1, 0, 50)], [3, 1], [2, 0])]
    if how == "drop":  # unrecordable: never queued
        d.drop(1, np.array([0, 1]))
    else:  # queued, then dropped by the writer (queue full, a layer without its rows)
        d.note(1, np.array([2, 0]), np.array([0, 1]))
    out.append(_run(d, 2, [(0, 8, 16), (0, 9, 17), (1, 2, 52)], [2, 1], [1, 0]))
    got = {r: np.concatenate([o["positions"][o["request_ids"] == r] for o in out]).tolist() for r in (0, 1)}
    assert got == {0: [3, 8], 1: [0, 2]}
    assert (d.rejected, d.unconfirmed, sorted(d.held)) == (0, 2, [0])
    out.append(_run(d, 3, [(0, 9, 17), (0, 10, 18)], [2], [1]))  # 9 rejected, judged by its next step
    assert out[-1]["positions"].tolist() == [9] and (d.rejected, d.unconfirmed) == (1, 2)


def test_close_waits_for_a_settle_still_running():
    """A drain that timed out leaves the writer settling while the recorder closes: close waits
    for the settle (it held the dict it changes), then leaves out what the settle held."""
    d = DraftRows()
    inside, go = threading.Event(), threading.Event()
    real = draft_rows.draft_mask

    def slow_mask(*a):
        inside.set()
        assert go.wait(10)
        return real(*a)

    lines = []
    d.note(0, np.array([2]), np.array([0]))
    fields = _step([(0, 3, 10), (0, 4, 11), (0, 5, 12)])
    settle = threading.Thread(target=d.settle, args=(0, fields, np.array([3]), np.ones(3, bool)))
    closer = threading.Thread(target=lambda: lines.append(d.close()))
    try:
        draft_rows.draft_mask = slow_mask
        settle.start()
        assert inside.wait(10)
        closer.start()
        closer.join(0.3)
        assert closer.is_alive(), "close ran beside settle"
    finally:
        go.set()
        settle.join(10)
        closer.join(10)
        draft_rows.draft_mask = real
    assert d.held == {} and d.unconfirmed == 2 and "2 of drafts whose request ended" in lines[0]


def test_the_recorders_file_is_closed_whatever_the_drafts_summary_meets(tmp_path):
    import queue

    from vllm_smoe.serving.record.recorder import Recorder

    class Boom:
        def close(self):
            raise RuntimeError("dictionary changed size during iteration")

    class Writer:
        num_tokens, path, closed = 3, str(tmp_path / "t.npz"), False
        spill_dir = str(tmp_path)  # still there: the close assembles it

        def close(self):
            self.closed = True
            return self.path

    rec = Recorder.__new__(Recorder)
    rec.queue, rec.lock, rec.drafts, rec.writer = queue.Queue(), threading.Lock(), Boom(), Writer()
    rec.cfg, rec.total, rec.step = types.SimpleNamespace(record=str(tmp_path), record_max_mb=None), 3, 1
    writer = rec.writer
    with pytest.raises(RuntimeError):
        rec.close()
    assert writer.closed and rec.writer is None


def test_draft_counts_without_the_schedulers_field():
    """A vLLM without ``scheduled_spec_decode_tokens``: no drafts when not speculating; unknown
    (None, never "none") when speculating."""
    so = types.SimpleNamespace(scheduled_spec_decode_tokens={"b": [7, 8]})
    assert draft_counts(so, ["a", "b"], True).tolist() == [0, 2]
    assert draft_counts(types.SimpleNamespace(), ["a", "b"], False).tolist() == [0, 0]
    assert draft_counts(types.SimpleNamespace(), ["a", "b"], True) is None


# the recorder served (stand-in routers, tests/unit/test_record_rows.py): request a decodes with
# two drafts a step, b without; step 0 runs a's 3 (4, 5 drafts), step 1 starts at 5 (4 kept) and
# runs 5 (6, 7 drafts), step 2 starts at 8 (6, 7 kept)
_SERVED = [[("a", 3, 10), ("a", 4, 11), ("a", 5, 12), ("b", 0, 50)],
           [("a", 5, 13), ("a", 6, 14), ("a", 7, 15), ("b", 1, 51)],
           [("a", 8, 16), ("a", 9, 17), ("a", 10, 18), ("b", 2, 52)]]


def _serve(rec, routers, rows, drafts, how=None):
    """One served step of ``rows`` (request, position, token); ``how`` drops it on a recorder path."""
    import queue

    import torch

    from vllm_smoe.serving.runner_hooks import Step

    req_ids = list(dict.fromkeys(r for r, _, _ in rows))
    counts = np.array([sum(q == r for r, _, _ in rows) for q in req_ids])
    so = types.SimpleNamespace(total_num_scheduled_tokens=len(rows), finished_req_ids=[], scheduled_new_reqs=[])
    if drafts is not None:
        so.scheduled_spec_decode_tokens = {q: [0] * k for q, k in drafts.items()}
    tok = torch.tensor([t for _, _, t in rows])
    rec.before_step(None, so)
    for layer, router in enumerate(routers):
        if not (how == "unrouted" and layer == 1):
            router.capture_fn(torch.stack([tok % 8, (tok + 1) % 8], 1).to(torch.int32))
    if how == "queue full":
        def full(item):
            raise queue.Full
        rec.queue.put_nowait = full
    rec.after_step(None, so, Step(req_ids, counts, None if how == "unrecordable" else tok,
                                  torch.tensor([p for _, p, _ in rows])))
    if how == "queue full":
        del rec.queue.put_nowait  # the queue's own again
    rec.drain()


def _written(tmp_path):
    from tests.unit.test_record_rows import _recorded

    got = _recorded(tmp_path, 0)
    return {r: got["positions"][got["request_ids"] == r].tolist() for r in (0, 1)}


@pytest.mark.parametrize("how", ["unrecordable", "queue full", "unrouted"])
def test_the_recorder_leaves_out_drafts_whose_next_step_it_dropped(tmp_path, monkeypatch, how):
    """Each of the recorder's drop paths drops step 1: request a's drafts at 4 and 5 are left out
    (counted), not written as kept because step 2 starts past them."""
    pytest.importorskip("vllm")
    from tests.unit.test_record_rows import _recorder

    rec, routers = _recorder(monkeypatch, tmp_path, 0, 0)
    for i, rows in enumerate(_SERVED):
        _serve(rec, routers, rows, {"a": 2}, how if i == 1 else None)
    rec.close()
    assert _written(tmp_path) == {0: [3, 8], 1: [0, 2]}
    assert (rec.drafts.rejected, rec.drafts.unconfirmed) == (0, 2 + 2)  # 4, 5; then step 2's 9, 10


def test_the_recorder_writes_no_step_when_drafts_are_unknown(tmp_path, monkeypatch, caplog):
    """Speculating on a vLLM whose scheduler output lacks scheduled_spec_decode_tokens: every row
    would have been written as kept; instead no step is, with one error, counted."""
    pytest.importorskip("vllm")
    from tests.unit.test_record_rows import _recorder

    rec, routers = _recorder(monkeypatch, tmp_path, 0, 0, speculative_config=object())
    with caplog.at_level("WARNING", logger="vllm.smoe"):
        for rows in _SERVED:
            _serve(rec, routers, rows, None)
    rec.close()
    assert rec.unrecordable == 12 and rec.total == 0
    assert caplog.text.count("no scheduled_spec_decode_tokens") == 1 and "not recorded" not in caplog.text
    rec, routers = _recorder(monkeypatch, tmp_path / "plain", 0, 0)  # not speculating: written
    for rows in _SERVED[:1]:
        _serve(rec, routers, rows, None)
    rec.close()
    assert _written(tmp_path / "plain") == {0: [3, 4, 5], 1: [0]}
