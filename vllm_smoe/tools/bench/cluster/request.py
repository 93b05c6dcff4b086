"""One streamed greedy request of the cluster's client: its timings, or its error."""

from __future__ import annotations

import time

from ..common import stream


def one_request(client, model, prompt, max_tokens, start_at=None):
    """(start s, [arrival s of each streamed chunk], completion tokens, error or None), sent at
    ``start_at`` (``time.perf_counter``'s clock) when given, else now."""
    if start_at is not None:
        time.sleep(max(0.0, start_at - time.perf_counter()))
    try:
        st, ts, n = stream(client, model, prompt, max_tokens)
        return st, ts, n, None
    except Exception as e:  # a failed request counts as failed, the run goes on
        return time.perf_counter(), [], 0, repr(e)
