"""Semantic request routing for attention data parallelism (Sem-MoE's request scheduler).

Under ``--data-parallel-size N --enable-expert-parallel`` every DP rank runs its own batch and
every MoE layer sends each token to the ranks holding its experts. Tokens never move before the
MoE there, so what smoe can choose is the rank a request runs on: the one whose experts (under
the placement) its prompt's tokens use most, as scored by the placement's token tables.

vLLM's front end picks a DP engine per request in ``DPLBAsyncMPClient.get_core_engine_for_request``
(its internal load balancer). With a placement that has tables and DP > 1, smoe wraps that
method, in the front-end process only; the choice and its balance masks: :func:`_choose`.

Nothing here touches a tensor or an engine: the choice is host-side numpy on the prompt's ids,
made once per request before it is sent, and greedy outputs do not depend on it (each engine
computes the same tokens for a request; only which ranks' experts are local changes)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import numpy as np

from ...placement.dp import CAPACITY, WINDOW, balance_mask, pick_rank, request_affinity, token_votes

MAX_SPAN = 1 << 14  # the longest window kept (requests), whatever is in flight

logger = logging.getLogger("vllm.smoe")



class RequestRouter:
    """Scores prompts against DP engines and keeps the sliding window of routed work.

    token2rank: [L, V, 2] int16 (-1 = unseen) and token_conf: [L, V] float: the placement's
    tables over its ``ep_size`` expert-parallel ranks; DP rank d holds EP ranks
    ``d * ep_size / dp_size ...`` (vLLM's EP rank = dp_rank * tp + tp_rank), so an engine's score
    is the sum of its ranks'. engine_ranks: the global DP ranks of the engines this client routes
    to, in its order (all of them, or a node's own under hybrid load balancing). nodes: the
    placement's (a vote also counts for its rank's node, see ``token_votes``). Not
    thread-safe: one per front-end client (vLLM calls it from its event loop)."""

    def __init__(self, token2rank: np.ndarray, token_conf: np.ndarray, ep_size: int, dp_size: int,
                 engine_ranks=None, capacity: float = CAPACITY, window: int = WINDOW, log_interval: float = 10.0,
                 nodes: int = 1):
        ranks = list(range(dp_size)) if engine_ranks is None else [int(r) for r in engine_ranks]
        if not ranks or min(ranks) < 0 or max(ranks) >= dp_size:
            raise ValueError(f"engine ranks {ranks} outside the {dp_size} DP ranks")
        # [V, engines]: a prompt's score is one gather and a sum (the placement/dp.py rule)
        self.votes = token_votes(token2rank, token_conf, ep_size, dp_size, nodes=nodes)[:, ranks]
        self.ep_size, self.num_engines = ep_size, len(ranks)
        self.capacity, self.window = capacity, window  # window: the fewest requests balanced over
        self.span = min(window, MAX_SPAN)  # the window in use: max(window, this front end's requests in flight)
        self.load = np.zeros(self.num_engines)  # routed work of the last ``span`` requests, per engine
        self.recent: deque[tuple[int, float]] = deque(maxlen=MAX_SPAN + 1)  # one past: the one leaving
        self.counts = {"placement": 0, "vllm": 0, "explicit": 0}
        self.per_engine = np.zeros(self.num_engines, dtype=np.int64)
        self.first_choice = 0  # requests routed to the engine they score best on, all engines open
        self.log_interval, self._last_log, self._timer = log_interval, time.monotonic(), None

    def scores(self, prompt_token_ids) -> np.ndarray:
        """[num_engines] float64 affinity of a prompt (token ids) to each engine."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        _, s, _ = request_affinity(None, None, ids, np.zeros(ids.size, np.int64), None, self.ep_size, self.votes)
        return s[0] if s.shape[0] else np.zeros(self.num_engines)

    def _resize(self, in_flight: int) -> None:
        """Balance over the last max(window, in_flight) routed requests: what is in flight when
        requests finish in arrival order. A long window at low load would let one engine
        take a burst; a short one at high load spreads requests a larger in-flight set would
        balance anyway, and locality is lost for nothing (BENCHMARKS.md, "Attention DP over nodes")."""
        span = min(max(self.window, int(in_flight)), MAX_SPAN)
        n = len(self.recent)
        # in flight moves by a request or two between calls: add or drop the requests between the spans
        for i in range(min(self.span, n), min(span, n)):
            e, w = self.recent[n - 1 - i]
            self.load[e] += w
        for i in range(min(span, n), min(self.span, n)):
            e, w = self.recent[n - 1 - i]
            self.load[e] -= w
        self.span = span

    def choose(self, prompt_token_ids, weight: float, waiting, client_count: int = 1, in_flight: int = 0) -> int:
        """The engine smoe routes a request to, or -1 = leave it to vLLM's balancer.
        waiting: [num_engines] vLLM's waiting-request count per engine, in which each of the
        ``client_count`` front ends counts a request it routes as ``client_count`` until the
        coordinator's next snapshot (100 ms); in_flight: this front end's requests in flight
        (vLLM's own count), which sets the window when it is above ``window``."""
        self._resize(in_flight)
        open_ = balance_mask(self.load, weight, self.capacity)
        # one request of slack, or a burst would alternate engines on vLLM's own estimate
        open_ &= balance_mask(np.asarray(waiting, dtype=np.float64), float(client_count), self.capacity,
                              slack=float(client_count))
        scores = self.scores(prompt_token_ids)
        choice = pick_rank(scores, open_) if open_.any() else -1
        if choice >= 0 and pick_rank(scores, np.ones(self.num_engines, dtype=bool)) == choice:
            self.first_choice += 1
        return choice

    def routed(self, engine: int, weight: float, how: str) -> None:
        """Account a request sent to ``engine`` (by ``how``: placement | vllm | explicit)."""
        self.recent.append((engine, weight))
        self.load[engine] += weight
        if len(self.recent) > self.span:  # the request that leaves the window (still in the history)
            e, w = self.recent[-self.span - 1]
            self.load[e] -= w
        self.counts[how] += 1
        self.per_engine[engine] += 1
        self._maybe_log()

    def _maybe_log(self) -> None:
        """A summary per log interval; the last one also after traffic stops (a timer on the
        front end's event loop, where vLLM routes), so the log covers every request."""
        now = time.monotonic()
        if now - self._last_log >= self.log_interval:
            self._last_log = now
            logger.info("%s", self.summary())
            return
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # called outside an event loop (tests, offline use): no timer
            self._timer = loop.call_later(self.log_interval - (now - self._last_log) + 1e-3, self._flush)

    def _flush(self) -> None:
        self._timer = None
        self._maybe_log()

    def summary(self) -> str:
        c = self.counts
        return (f"smoe dp routing: {sum(c.values())} requests: {c['placement']} by the placement "
                f"({self.first_choice} on their best-scoring engine), {c['vllm']} left to vLLM's balancer, "
                f"{c['explicit']} with their own rank; per engine {self.per_engine.tolist()}")


def router_for(vllm_config, engine_ranks) -> RequestRouter | None:
    """The router a front-end client should use, or None (smoe not asked, routing off, no
    expert parallelism, no tables). A placement or tables file that no longer reads (changed
    since the server was checked at start) is logged as an error and routing stays vLLM's."""
    from ..config import SmoeConfig
    from ..served import placement_for

    cfg = SmoeConfig.from_additional_config(vllm_config.additional_config)
    pc = vllm_config.parallel_config
    if cfg is None or not cfg.dp_routing or cfg.placement is None or not pc.enable_expert_parallel:
        return None
    try:
        served = placement_for(cfg)  # parsed once in this process (the plugin's checks read it first)
        placement, tables = served.placement, served.tables
        if tables is None:
            return None
        router = RequestRouter(tables.token2rank, tables.token_conf, placement.ep_size, pc.data_parallel_size,
                               engine_ranks, capacity=placement.capacity, log_interval=cfg.log_interval,
                               nodes=placement.nodes)
    except ValueError as e:
        logger.error("smoe dp routing is off for this front end, every request goes to vLLM's balancer: %s", e)
        return None
    logger.info("smoe dp routing: requests scored against %s over DP engines %s (window %d, capacity %.2f)",
                placement.path, list(engine_ranks), router.window, router.capacity)
    return router


def _attach(client):
    ranks = getattr(client, "engine_ranks_managed", None) or range(len(client.core_engines))
    client._smoe_router = router_for(client.vllm_config, ranks)
    return client._smoe_router


def _choose(orig, client, request):
    """vLLM's ``get_core_engine_for_request`` (``orig``) with smoe's choice of the engine.

    - a request that names its rank (``data_parallel_rank``, the ``X-data-parallel-rank`` header),
      or one vLLM routes by its own rule (late interaction, session affinity), is vLLM's;
    - otherwise the request's scores (:func:`vllm_smoe.placement.dp.request_affinity`) pick the
      best engine among those two balance masks leave open (:func:`~vllm_smoe.placement.dp.balance_mask`):
      the routed work (prompt + max new tokens) of the last ``WINDOW`` requests, or of as many as
      the front end has in flight where that is more, exactly as ``smoe-place evaluate --mode dp
      --in-flight`` simulates it, and vLLM's own count of waiting requests per
      engine (one request of slack), so no engine gets more than its share of queued work;
    - when no open engine scores strictly best (an unseen prompt, a tie, everything masked), vLLM's
      balancer chooses as it would without smoe."""
    router = client.__dict__.get("_smoe_router", False)
    if router is False:  # a client built before the wrapper was installed
        router = _attach(client)
    if router is not None and (len(client.core_engines) != router.num_engines
                               or len(client.lb_engines) != router.num_engines):
        logger.warning("smoe dp routing is off: the DP engines changed (%d, routed for %d; elastic "
                       "scaling); the placement no longer matches them", len(client.core_engines),
                       router.num_engines)
        router = client._smoe_router = None
    if router is None or request.request_id in client.reqs_in_flight or request.prompt_token_ids is None:
        return orig(client, request)
    sp = request.sampling_params
    weight = len(request.prompt_token_ids) + ((sp.max_tokens or 0) if sp is not None else 0)
    if request.data_parallel_rank is not None or request.pooling_params is not None:
        # a named rank is the client's; pooling requests keep vLLM's own rules
        engine = orig(client, request)
        router.routed(client.core_engines.index(engine), weight,
                      "explicit" if request.data_parallel_rank is not None else "vllm")
        return engine
    choice = router.choose(request.prompt_token_ids, weight, [c[0] for c in client.lb_engines],
                           client.client_count, sum(client.engine_inflight.values()))
    if choice < 0:
        engine = orig(client, request)
        router.routed(client.core_engines.index(engine), weight, "vllm")
        return engine
    # vLLM's explicit-rank path does its own bookkeeping (in-flight request, abort routing);
    # the waiting count its balancer adds between coordinator snapshots is added here
    request.data_parallel_rank = choice
    try:
        engine = orig(client, request)
    finally:
        request.data_parallel_rank = None
    client.lb_engines[choice][0] += client.client_count
    router.routed(choice, weight, "placement")
    return engine


def install() -> None:
    """Wrap vLLM's DP load balancer (idempotent; a no-op for clients whose config does not ask)."""
    from ..patches import dp_client

    dp_client.install(_attach, _choose)


_SCORERS: dict[tuple[str, int], RequestRouter] = {}


def preferred_rank(placement_path: str, prompt_token_ids, num_engines: int | None = None
                   ) -> tuple[int | None, list[float]]:
    """For routers outside vLLM (``--data-parallel-external-lb``): the DP rank a prompt should run
    on under a placement, and its score on every rank. prompt_token_ids: the prompt's token ids
    (the served model's tokenizer); num_engines: DP size (default the placement's ep_size, i.e.
    TP = 1). rank is None when no rank scores strictly best. Balance is the caller's: combine the
    scores with the caller's own load view. The placement and its tables are read once per path."""
    key = (placement_path, num_engines or 0)
    scorer = _SCORERS.get(key)
    if scorer is None:
        from ...formats.placement_file import load_placement, load_tables

        placement = load_placement(placement_path)
        tables = load_tables(placement)
        scorer = _SCORERS[key] = RequestRouter(tables.token2rank, tables.token_conf, placement.ep_size,
                                               num_engines or placement.ep_size, nodes=placement.nodes)
    s = scorer.scores(prompt_token_ids)
    best = pick_rank(s, np.ones(s.size, dtype=bool))
    return (None if best < 0 else best), s.tolist()
