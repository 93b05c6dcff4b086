"""smoe's HTTP routes on vLLM's API server (entry point ``vllm.endpoint_plugins``: ``smoe``).

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (it treats new routes as new
attack surface), so: ``VLLM_PLUGINS=smoe vllm serve M --plugin smoe --smoe-placement P ...``
(naming it there also allowlists smoe's general plugin, which has the same name).

Routes (each told in :class:`SmoeEndpoints`): ``POST /smoe/route`` (the DP rank a prompt's
tokens score best on, for a router in front of ``--data-parallel-external-lb`` servers),
``POST`` / ``GET /smoe/placement`` (serve a new placement without a restart; the served one),
and vLLM's ``GET /health``, 503 while a swap's move is overdue or has failed.

Every route honours vLLM's ``--api-key`` / ``VLLM_API_KEY`` exactly as ``/v1`` does (vLLM's own
check, which guards only its prefixes): 401 without the key. Bodies are capped in size, and a
text prompt is tokenized off the event loop and capped at the model's length."""

import asyncio
import json
import logging

from fastapi import APIRouter, HTTPException, Request  # FastAPI resolves the handler's annotations
from fastapi.responses import JSONResponse, Response

MAX_BODY = 1 << 20  # bytes of a request body besides its prompt (a path, a few fields)
logger = logging.getLogger("vllm.smoe")


class SmoeEndpoints:
    """smoe's routes, attached to vLLM's FastAPI app (:meth:`attach_router`).

    ``POST /smoe/route`` with ``{"prompt": "text"}`` or ``{"prompt_token_ids": [...]}`` answers
    ``{"rank": r | null, "scores": [...], "placement": path}``: the DP rank the prompt's tokens
    score best on under the server's placement (null = no preference), for a router in front of
    ``--data-parallel-external-lb`` servers. Balance is the router's own. A text prompt is tokenized
    as it is (no chat template): send the token ids the server will see for chat requests.

    ``POST /smoe/placement`` with ``{"placement": "<path>"}`` serves a new placement without a restart
    (:mod:`.live`): checked first (400 with the file and field named, the old placement stays),
    then weights, routers and tables swapped between two engine steps; the answer comes when every
    worker is done: ``{"placement", "previous", "moved_slots", "seconds"}``. ``GET /smoe/placement``
    answers the served one. The swap itself is :func:`.place.swap.swap` (one at a time; requests
    keep running; the file read once, here, from the served placement's directory and those
    ``--smoe-placement-dirs`` adds; workers parse those bytes). A move that misses its deadline
    stops the server instead of hanging it, and a stopping server ends a swap that waits.

    ``GET /health`` is vLLM's (the endpoint plugin's route override), and 503 while a swap's move
    is past its deadline or has failed (:meth:`.place.swap.LiveState.unhealthy`)."""

    name = "smoe"
    required_tasks = ("generate",)
    unhealthy_said = ""  # the last reason /health answered 503 for, logged once

    def attach_router(self, app) -> None:
        router = APIRouter()
        from .observe.metrics import SmoeCollector, multiprocess_registry

        self.collector = SmoeCollector(None)  # its directory comes with the settings (init_state)
        registry = multiprocess_registry(self.collector)
        if registry is not None:  # several API servers: vLLM's /metrics registry is per process, so
            # this route replaces vLLM's (endpoint plugins may) with the same registry plus smoe's
            @router.get("/metrics")
            async def metrics(raw: Request):
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
                from fastapi.responses import Response

                return Response(await asyncio.to_thread(generate_latest, registry), media_type=CONTENT_TYPE_LATEST)

        @router.post("/smoe/route")
        async def route(raw: Request):
            if (denied := _denied(raw)) is not None:
                return denied
            state = raw.app.state
            placement, engines, tokenizer = state.smoe_route
            if placement is None:
                raise HTTPException(status_code=404, detail="this server runs without an smoe placement with "
                                                            "tables (--plugin smoe --smoe-placement P)")
            limit = getattr(state, "smoe_max_tokens", 1 << 20)  # set at start (init_state)
            # a prompt as ids costs ~12 bytes a token in JSON, as text a few per token
            body = await _json_object(raw, MAX_BODY + 24 * limit)
            ids, text = body.get("prompt_token_ids"), body.get("prompt")
            if ids is None and isinstance(text, str):
                if tokenizer is None:
                    raise HTTPException(status_code=400, detail="this server has no tokenizer "
                                                                "(--skip-tokenizer-init): send 'prompt_token_ids'")
                ids = await asyncio.to_thread(tokenizer.encode, text)  # never on the event loop
            if isinstance(ids, list) and len(ids) > limit:
                raise HTTPException(status_code=400, detail=f"the prompt has {len(ids)} tokens, more than the model's "
                                                            f"{limit} (--max-model-len)")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    and 0 <= i < 2**62 for i in ids):
                raise HTTPException(status_code=400, detail="give 'prompt' (a string) or 'prompt_token_ids' "
                                                            "(a list of non-negative integers)")
            from .dp.router import preferred_rank

            try:
                rank, scores = preferred_rank(placement, ids, engines)
            except ValueError as e:  # the placement no longer reads, or does not fit the DP size
                raise HTTPException(status_code=409, detail=str(e)) from None
            return {"rank": rank, "scores": scores, "placement": placement}

        @router.get("/smoe/placement")
        async def get_placement(raw: Request):
            if (denied := _denied(raw)) is not None:
                return denied
            live = raw.app.state.smoe_live
            if live is None or live.path is None:
                raise HTTPException(status_code=404, detail="this server runs without an smoe placement")
            return {"placement": live.path, "swaps": live.swaps, "last_swap": live.last}

        @router.post("/smoe/placement")
        async def post_placement(raw: Request):
            if (denied := _denied(raw)) is not None:
                return denied
            live = raw.app.state.smoe_live
            if live is None or live.path is None:
                raise HTTPException(status_code=404, detail="this server runs without an smoe placement "
                                                            "(--plugin smoe --smoe-placement P): nothing to swap")
            path = (await _json_object(raw, MAX_BODY)).get("placement")
            if not isinstance(path, str) or not path:
                raise HTTPException(status_code=400, detail="give 'placement': the path of a placement YAML")
            from .place.swap import SwapError, swap

            try:
                return await swap(live, path)
            except SwapError as e:
                raise HTTPException(status_code=e.status, detail=e.detail) from None

        try:  # vLLM's own check, which this route answers first
            from vllm.entrypoints.serve.instrumentator.health import health as vllm_health
        except ImportError:  # another vLLM: its /health stays as it is
            vllm_health = None
        if vllm_health is not None:
            @router.get("/health", response_class=Response)
            async def health(raw: Request) -> Response:
                """vLLM's /health, and 503 while a live swap leaves the model in doubt: its move past
                the deadline (the server stops unless it ends) or failed (the server is stopping)."""
                answer = await vllm_health(raw)
                live = getattr(raw.app.state, "smoe_live", None)
                why = live.unhealthy() if live is not None and answer.status_code == 200 else ""
                if not why:
                    return answer
                if why != self.unhealthy_said:
                    self.unhealthy_said = why
                    logger.warning("smoe: /health answers 503: %s", why)
                return Response(status_code=503)

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        state.smoe_auth = _auth(args)
        state.smoe_max_tokens = 1 << 20
        if engine_client is None:  # vLLM's render-only server: nothing to score against
            state.smoe_route = (None, None, None)
            state.smoe_live = None
            return
        from .config import SmoeConfig

        vc = engine_client.vllm_config
        state.smoe_max_tokens = int(vc.model_config.max_model_len)
        cfg = SmoeConfig.from_additional_config(vc.additional_config)
        if cfg is not None and hasattr(self, "collector"):
            from .observe.metrics import metrics_dir

            self.collector.directory = metrics_dir(cfg)  # what this server's workers publish
        if cfg is None:
            state.smoe_live = None
        else:
            from .place.swap import LiveState

            state.smoe_live = LiveState.start(engine_client, vc, cfg)
            if cfg.auto_replace is not None and not state.smoe_live.refused:  # refused at start otherwise
                from .place import auto

                self.auto_task = auto.start(state.smoe_live, cfg)  # held: the loop keeps only weak references
        placement = cfg.placement if cfg is not None else None
        tokenizer = None
        if placement is not None:
            from .served import placement_for

            if placement_for(cfg).placement.predictor is None:
                placement = None  # nothing to score with: the route answers 404
            elif not vc.model_config.skip_tokenizer_init:
                tokenizer = engine_client.renderer.get_tokenizer()
        state.smoe_route = (placement, vc.parallel_config.data_parallel_size, tokenizer)


def _auth(args):
    """vLLM's own API-key check for these routes, built from the same settings with the same
    precedence (--api-key over VLLM_API_KEY), or None when the server has no key."""
    from vllm import envs

    tokens = [key for key in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if key]
    if not tokens:
        return None
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    return AuthenticationMiddleware(None, tokens=tokens)  # only its verify_token is used


def _denied(raw: Request) -> JSONResponse | None:
    """vLLM's 401 for /v1 when the request lacks the server's key, else None."""
    auth = getattr(raw.app.state, "smoe_auth", None)
    if auth is not None and not auth.verify_token(raw.headers):
        return JSONResponse(content={"error": "Unauthorized"}, status_code=401)
    return None


async def _json_object(raw: Request, max_bytes: int) -> dict:
    """The request's JSON body; {} when it is JSON but not an object (each route names what it
    needs). Bodies over ``max_bytes`` are refused before they are read whole or parsed."""
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPException(status_code=413, detail=f"body over {max_bytes} bytes")
    data = bytearray()
    async for chunk in raw.stream():
        data += chunk
        if len(data) > max_bytes:
            raise HTTPException(status_code=413, detail=f"body over {max_bytes} bytes")
    try:
        body = json.loads(data) if len(data) < 65536 else await asyncio.to_thread(json.loads, bytes(data))
    except (ValueError, RecursionError):
        raise HTTPException(status_code=400, detail="body must be JSON (not too deeply nested)") from None
    return body if isinstance(body, dict) else {}


def endpoints() -> SmoeEndpoints:
    return SmoeEndpoints()
