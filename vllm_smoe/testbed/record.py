"""Routing of a checkpoint on text, computed with transformers (independent of vLLM).

Each request is one window of ``seq_len`` tokens of one domain, processed as a prefill; its
router top-k at every MoE layer is written to the routing-trace format.
"""

from __future__ import annotations

import numpy as np

from ..formats.trace import TraceMeta, TraceWriter
from .corpus import DOMAINS


def router_topk(model, input_ids, top_k: int):
    """Per MoE layer top-k ids and weights for one batch, as transformers' router computes them.

    input_ids: [B, S] int64. Returns (ids [B*S, L, K] int32, weights [B*S, L, K] float32).
    Routers that return their own choice (DeepSeek's ``(logits, weights, indices)``, grouped
    top-k and correction bias included) are read as they are; otherwise the top-k is taken on
    the router's softmax, which ranks like its logits, with weights normalised.
    """
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopkRouter")]
    if routers:
        got: list = []
        hooks = [r.register_forward_hook(lambda mod, args, out: got.append((out[2], out[1]))) for r in routers]
        try:
            with torch.no_grad():
                model(input_ids=input_ids)
        finally:
            for h in hooks:
                h.remove()
        ids = torch.stack([i for i, _ in got], dim=1)  # [B*S, L, K]
        w = torch.stack([w.float() for _, w in got], dim=1)
        return ids.to(torch.int32).numpy(), w.numpy()
    with torch.no_grad():
        out = model(input_ids=input_ids, output_router_logits=True)
    logits = torch.stack([r.float() for r in out.router_logits], dim=1)  # [B*S, L, E]
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32).numpy(), w.numpy()


def record_domains(model_dir: str, token_ids: dict[str, np.ndarray], out_path: str, seq_len: int = 128,
                   requests_per_step: int = 4, max_requests_per_domain: int = 64, threads: int = 2) -> str:
    """Write the routing of ``token_ids`` (domain -> int32 [n]) through ``model_dir`` to ``out_path``."""
    import torch
    from transformers import AutoModelForCausalLM

    from .models import moe_shape

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    shape = moe_shape(model.config)
    doms = [d for d in DOMAINS if d in token_ids]
    meta = TraceMeta(num_experts=shape["num_experts"], top_k=shape["top_k"], num_layers=shape["num_layers"],
                     vocab_size=model.config.vocab_size, domains=tuple(doms), model=model_dir,
                     hidden_size=model.config.hidden_size)
    from tqdm import tqdm

    req = 0
    with TraceWriter(out_path, meta) as w:
        for di, d in enumerate(doms):
            arr = token_ids[d]
            n_req = min(max_requests_per_domain, len(arr) // seq_len)
            windows = arr[: n_req * seq_len].reshape(n_req, seq_len)
            for b0 in tqdm(range(0, n_req, requests_per_step), desc=f"record {d}", mininterval=5):
                x = windows[b0: b0 + requests_per_step]
                ids, wts = router_topk(model, torch.from_numpy(x.astype(np.int64)), shape["top_k"])
                B = x.shape[0]
                w.append(
                    token_ids=x.reshape(-1).astype(np.int32),
                    request_ids=np.repeat(np.arange(req, req + B, dtype=np.int32), seq_len),
                    positions=np.tile(np.arange(seq_len, dtype=np.int32), B),
                    topk_ids=ids.astype(np.int16),
                    topk_weights=wts.astype(np.float16),
                    step_ids=np.full(B * seq_len, req // requests_per_step, dtype=np.int32),
                    is_prefill=np.ones(B * seq_len, dtype=bool),
                    domain=np.full(B * seq_len, di, dtype=np.int8),
                )
                req += B
    return out_path
