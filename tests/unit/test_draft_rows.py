"""Recording under speculative decoding: a draft token's row waits for its request's next step;
rejected drafts' rows never reach the trace (:mod:`vllm_smoe.serving.draft_rows`)."""

import numpy as np

from vllm_smoe.serving.draft_rows import DraftRows, draft_mask


def test_draft_mask_is_the_last_drafts_of_each_request():
    got = draft_mask(np.array([3, 1, 4]), np.array([2, 0, 1]))
    assert got.tolist() == [False, True, True, False, False, False, False, True]


def _step(rows, req_ids=None):
    """One step's fields from (request, position, token) rows, in order."""
    req, pos, tok = (np.array(c) for c in zip(*rows))
    return {"token_ids": tok.astype(np.int32), "request_ids": req.astype(np.int32), "positions": pos.astype(np.int32),
            "topk_ids": np.stack([tok, tok], 1)[:, None].astype(np.int16), "step_ids": np.zeros(len(rows), np.int32),
            "is_prefill": np.zeros(len(rows), bool)}


def _run(d, step, rows, counts, drafts, finished=()):
    for r in finished:
        d.finished(r)
    d.note(step, np.array(drafts))
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
    d.note(1, np.array([0]))  # step 1 dropped (the writer fell behind): never settled
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
