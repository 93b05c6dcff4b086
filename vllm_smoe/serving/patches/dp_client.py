"""vLLM's front-end DP load balancer (``DPLBAsyncMPClient``), wrapped so smoe's request routing
(:mod:`vllm_smoe.serving.dp.router`) chooses the engine of a request its placement scores.
vLLM has no pluggable routing policy for its internal balancer (see :data:`..PATCHES`)."""

from __future__ import annotations

from typing import Callable

from . import replace

_INSTALLED = False


def install(attach: Callable, choose: Callable) -> None:
    """``attach(client)`` after the client's ``__init__``; ``choose(orig, client, request)``
    instead of ``get_core_engine_for_request`` (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    orig = DPLBAsyncMPClient.get_core_engine_for_request
    orig_init = DPLBAsyncMPClient.__init__

    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        attach(self)  # tables read while the server starts, not on its first request

    def get_core_engine_for_request(self, request):
        return choose(orig, self, request)

    replace("dplb_get_core_engine_for_request", DPLBAsyncMPClient, "get_core_engine_for_request",
            get_core_engine_for_request)
    replace("dplb_init", DPLBAsyncMPClient, "__init__", __init__)
    _INSTALLED = True
