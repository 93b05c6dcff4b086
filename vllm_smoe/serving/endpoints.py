"""smoe's HTTP routes on vLLM's API server (entry point ``vllm.endpoint_plugins``: ``smoe``).

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS`` (it treats new routes as new
attack surface), so: ``VLLM_PLUGINS=smoe vllm serve M --plugin smoe --smoe-placement P ...``
(naming it there also allowlists smoe's general plugin, which has the same name).

``POST /smoe/route`` with ``{"prompt": "text"}`` or ``{"prompt_token_ids": [...]}`` answers
``{"rank": r | null, "scores": [...], "placement": path}``: the DP rank the prompt's tokens
score best on under the server's placement (null = no preference), for a router in front of
``--data-parallel-external-lb`` servers. Balance is the router's own. A text prompt is tokenized
as it is (no chat template): send the token ids the server will see for chat requests.
"""

from fastapi import APIRouter, HTTPException, Request  # FastAPI resolves the handler's annotations


class SmoeEndpoints:
    name = "smoe"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        router = APIRouter()

        @router.post("/smoe/route")
        async def route(raw: Request):
            state = raw.app.state
            placement, engines, tokenizer = state.smoe_route
            if placement is None:
                raise HTTPException(status_code=404, detail="this server runs without an smoe placement with "
                                                            "tables (--plugin smoe --smoe-placement P)")
            try:
                body = await raw.json()
            except ValueError:
                raise HTTPException(status_code=400, detail="body must be JSON") from None
            ids = body.get("prompt_token_ids") if isinstance(body, dict) else None
            text = body.get("prompt") if isinstance(body, dict) else None
            if ids is None and isinstance(text, str):
                if tokenizer is None:
                    raise HTTPException(status_code=400, detail="this server has no tokenizer "
                                                                "(--skip-tokenizer-init): send 'prompt_token_ids'")
                ids = tokenizer.encode(text)
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    and 0 <= i < 2**62 for i in ids):
                raise HTTPException(status_code=400, detail="give 'prompt' (a string) or 'prompt_token_ids' "
                                                            "(a list of non-negative integers)")
            from .dp_router import preferred_rank

            try:
                rank, scores = preferred_rank(placement, ids, engines)
            except ValueError as e:  # the placement no longer reads, or does not fit the DP size
                raise HTTPException(status_code=409, detail=str(e)) from None
            return {"rank": rank, "scores": scores, "placement": placement}

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:  # vLLM's render-only server: nothing to score against
            state.smoe_route = (None, None, None)
            return
        from ..config import SmoeConfig

        vc = engine_client.vllm_config
        cfg = SmoeConfig.from_additional_config(vc.additional_config)
        placement = cfg.placement if cfg is not None else None
        tokenizer = None
        if placement is not None:
            from ..placement_file import load_placement

            if load_placement(placement).predictor is None:
                placement = None  # nothing to score with: the route answers 404
            elif not vc.model_config.skip_tokenizer_init:
                tokenizer = engine_client.renderer.get_tokenizer()
        state.smoe_route = (placement, vc.parallel_config.data_parallel_size, tokenizer)


def endpoints() -> SmoeEndpoints:
    return SmoeEndpoints()
