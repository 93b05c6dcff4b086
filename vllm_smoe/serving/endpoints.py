"""smoe's HTTP routes on vLLM's API server (entry point ``vllm.endpoint_plugins``: ``smoe``).

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (it treats new routes as new
attack surface), so: ``VLLM_PLUGINS=smoe vllm serve M --plugin smoe --smoe-placement P ...``
(naming it there also allowlists smoe's general plugin, which has the same name).

``POST /smoe/route`` with ``{"prompt": "text"}`` or ``{"prompt_token_ids": [...]}`` answers
``{"rank": r | null, "scores": [...], "placement": path}``: the DP rank the prompt's tokens
score best on under the server's placement (null = no preference), for a router in front of
``--data-parallel-external-lb`` servers. Balance is the router's own. A text prompt is tokenized
as it is (no chat template): send the token ids the server will see for chat requests.

``POST /smoe/placement`` with ``{"placement": "<path>"}`` serves a new placement without a restart
(:mod:`.live`): checked first (400 with the file and field named, the old placement stays),
then weights, routers and tables swapped between two engine steps; the answer comes when every
worker is done: ``{"placement", "previous", "moved_slots", "seconds"}``. ``GET /smoe/placement``
answers the served one. Swaps are taken one at a time; requests keep running. The file is
resolved and read once, here, and only from the directories the server takes placements from
(``--smoe-placement-dirs``; default: the served placement's); workers parse those bytes. A move
that misses its deadline (:func:`apply_deadline`) stops the server instead of hanging it.

Every route honours vLLM's ``--api-key`` / ``VLLM_API_KEY`` exactly as ``/v1`` does (vLLM's own
check, which guards only its prefixes): 401 without the key. Bodies are capped in size, and a
text prompt is tokenized off the event loop and capped at the model's length.
"""

import asyncio
import json
import logging
import os
import signal
import time

from fastapi import APIRouter, HTTPException, Request  # FastAPI resolves the handler's annotations
from fastapi.responses import JSONResponse

EXTENSION = "vllm_smoe.serving.place.live.SmoeWorkerExtension"
PREPARE_S = 300.0  # collective_rpc timeout for parsing and checking a placement on every worker
# the move's deadline: a fixed part plus the rank's changing expert bytes at a slow link's rate
APPLY_BASE_S, APPLY_BYTES_PER_S = 60.0, 50e6
MAX_BODY = 1 << 20  # bytes of a request body besides its prompt (a path, a few fields)
logger = logging.getLogger("vllm.smoe")


class SmoeEndpoints:
    name = "smoe"
    required_tasks = ("generate",)

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
            if live is None or live["path"] is None:
                raise HTTPException(status_code=404, detail="this server runs without an smoe placement")
            return {"placement": live["path"], "swaps": live["swaps"], "last_swap": live["last"]}

        @router.post("/smoe/placement")
        async def post_placement(raw: Request):
            if (denied := _denied(raw)) is not None:
                return denied
            live = raw.app.state.smoe_live
            if live is None or live["path"] is None:
                raise HTTPException(status_code=404, detail="this server runs without an smoe placement "
                                                            "(--plugin smoe --smoe-placement P): nothing to swap")
            path = (await _json_object(raw, MAX_BODY)).get("placement")
            if not isinstance(path, str) or not path:
                raise HTTPException(status_code=400, detail="give 'placement': the path of a placement YAML")
            path = os.path.abspath(path)
            from ..formats.placement_file import read_snapshot
            from .place.check import check_served_placement

            async with live["lock"]:  # one swap at a time
                if live["refused"]:
                    raise HTTPException(status_code=409, detail=live["refused"])
                try:  # read once (resolved, inside the allowed directories); the API server's own
                    # check first: a bad file never reaches the engine
                    snap = await asyncio.to_thread(read_snapshot, path, live["cfg"].placement_dirs)
                    await asyncio.to_thread(check_served_placement, snap.path, live["cfg"], live["vllm_config"],
                                            snap)
                except ValueError as e:
                    raise HTTPException(status_code=400, detail=str(e)) from None
                engine = live["engine"]
                t0 = time.monotonic()
                # every worker parses these bytes, never the path, and allocates the transfer
                # buffers; apply then only moves, so whatever can be refused is refused, on every
                # worker, before a byte moves
                ready = await engine.collective_rpc("smoe_prepare_placement", timeout=PREPARE_S,
                                                    args=(snap.path, snap.yaml, snap.tables, snap.sha256))
                reasons = [r["reason"] for r in ready if r["reason"]]
                if reasons:  # the ranks that were ready free what they allocated
                    await engine.collective_rpc("smoe_cancel_placement", timeout=PREPARE_S)
                    raise HTTPException(status_code=400, detail=reasons[0])
                deadline = apply_deadline(max(r["bytes"] for r in ready))
                try:  # shielded: a client that goes away does not leave the swap half-recorded here
                    done = await asyncio.shield(engine.collective_rpc("smoe_apply_placement", timeout=deadline,
                                                                      args=(snap.sha256,)))
                except Exception as e:  # noqa: BLE001 - the weights are in an unknown state: stop serving
                    live["refused"] = (f"a live swap to {path} failed while weights moved ({type(e).__name__}: "
                                       f"{e}; its deadline was {deadline:.0f} s); this server "
                                       f"stops rather than answer from a half-moved model")
                    logger.error("smoe: %s", live["refused"])
                    asyncio.get_running_loop().call_later(0.5, _stop_server)  # after the answer is out
                    raise HTTPException(status_code=500, detail=live["refused"]) from None
                answer = {"placement": path, "previous": live["path"],
                          "moved_slots": done[0]["moved_slots"],
                          # expert weight bytes written into changed slots, all ranks together
                          "moved_bytes": sum(r["bytes"] for r in ready),
                          "seconds": time.monotonic() - t0, "worker_seconds": max(d["seconds"] for d in done)}
                live["path"], live["last"] = path, answer
                live["swaps"] += 1
            return answer

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
        state.smoe_live = None if cfg is None else {
            "engine": engine_client, "vllm_config": vc, "cfg": cfg, "path": cfg.placement, "lock": asyncio.Lock(),
            "swaps": 0, "last": None, "refused": _live_refused(vc)}
        placement = cfg.placement if cfg is not None else None
        tokenizer = None
        if placement is not None:
            from .served import placement_for

            if placement_for(cfg).placement.predictor is None:
                placement = None  # nothing to score with: the route answers 404
            elif not vc.model_config.skip_tokenizer_init:
                tokenizer = engine_client.renderer.get_tokenizer()
        state.smoe_route = (placement, vc.parallel_config.data_parallel_size, tokenizer)


def apply_deadline(moved_bytes: int) -> float:
    """Seconds a swap's weight move may take before the server gives up and stops (a rank that
    cannot finish would otherwise hold every other rank in the transfer, behind a healthy
    /health): generous for a slow link, never the collective timeout's half hour."""
    return APPLY_BASE_S + moved_bytes / APPLY_BYTES_PER_S


def _stop_server() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # vLLM's API server shuts its engines down on SIGTERM


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


def _live_refused(vllm_config) -> str:
    """Why this server cannot swap placements live ('' = it can)."""
    pc = vllm_config.parallel_config
    if pc.data_parallel_size > 1:
        return ("live re-placement needs --data-parallel-size 1: DP engines step on their own, so no moment lies "
                "between the steps of all of them; restart with the new placement")
    if pc.pipeline_parallel_size > 1:
        return "live re-placement needs --pipeline-parallel-size 1; restart with the new placement"
    if pc.enable_eplb:
        return ("--enable-eplb moves experts at run time, so the served layout is no longer the placement's; "
                "restart with the new placement")
    if getattr(pc, "_api_process_count", 1) > 1:
        return ("live re-placement needs one API server (--api-server-count 1): each would swap on its own; "
                "restart with the new placement")
    if pc.worker_extension_cls != EXTENSION:
        return f"--worker-extension-cls {pc.worker_extension_cls} replaces smoe's, which live re-placement calls"
    return ""


def endpoints() -> SmoeEndpoints:
    return SmoeEndpoints()
