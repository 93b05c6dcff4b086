"""What the tests share: the repository's paths, held-out prompts of the trained fixture and
placement files that move every expert. Import it as ``from tests.support import ...``."""

import os

import numpy as np
import yaml

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
CONFIGS = os.path.join(REPO, "configs")
# vLLM's offline engine in a child process: argv model, prompts (JSON), max_tokens[, extra config (JSON)]
HELPER = os.path.join(TESTS, "helpers", "vllm_generate.py")


def heldout_prompts(n, length=lambda i, r: 3 + i, trace=None, skip=None):
    """The first ``length(i, r)`` tokens of n held-out requests (the i-th chosen, request id r) of
    ``trace`` (default: the Qwen3 fixture's held-out split): requests spread evenly over the trace,
    or with ``skip``, the n requests after the first ``skip``."""
    from vllm_smoe.formats.trace import open_trace
    from vllm_smoe.testbed import FIXTURE_TRACES

    t = open_trace(trace or FIXTURE_TRACES["heldout"])
    tok, req = t["token_ids"], t["request_ids"]
    reqs = np.unique(req)
    reqs = reqs[skip: skip + n] if skip is not None else reqs[:: max(1, len(reqs) // n)][:n]
    return [tok[req == r][: length(i, r)].tolist() for i, r in enumerate(reqs)]


def transformers_greedy(model, prompt, n):
    """The n tokens transformers' ``model`` generates greedily after ``prompt`` (ids), full
    forward passes without a cache: the reference vLLM's greedy tokens are checked against."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def derangement_yaml(path, shift=1, ep=32, layers=4, experts=32, step=1, **model):
    """A placement file moving expert e of layer i to slot (e + shift + step * i) % experts,
    ``experts // ep`` slots a rank; ``model`` adds fields to its model section. Returns str(path)."""
    doc = {"smoe_placement": 1, "model": {"num_layers": layers, "num_experts": experts, "top_k": 4, **model},
           "ep_size": ep, "layers": [{"expert_to_rank": [((e + shift + step * i) % experts) * ep // experts
                                                         for e in range(experts)]} for i in range(layers)]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)
