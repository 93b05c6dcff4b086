"""Speculative-decoding drafts (``--speculative-config``): left to vLLM.

vLLM loads a draft model (EAGLE heads, MTP modules, a separate draft model) through the target's
load format, so smoe's loader is asked for it as well. A placement, a recording and a token order
are built for the target's MoE layers; applied to a draft they would fail (another expert count,
no MoE layers: "found 0 MoE routers") or quietly go wrong (the draft's worker state replacing the
target's, its routing written as the target's). So the loader hands a draft to vLLM's own loading
and builds nothing around it. Where the draft has MoE layers of its own they are served as vLLM
serves them: in checkpoint order, not recorded, not swapped live. Told apart from
the target by what vLLM gives the loader, identically in vLLM 0.32 and 0.33 (see :func:`is_draft`).
No torch here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.smoe")


def is_draft(vllm_config, model_config) -> bool:
    """Is ``model_config`` (what vLLM's ``get_model`` hands the loader) a speculative draft of
    ``vllm_config``'s target?

    - A draft with weights of its own (draft model, EAGLE, MTP, Medusa, ...) gets a ModelConfig
      built with ``runner="draft"`` (``config/speculative.py``), whose ``runner_type`` stays
      "draft" (``config/model.py``). The draft-model proposers load it with a copy of the vLLM
      config whose ``model_config`` *is* the draft's (``v1/spec_decode/draft_model.py``), so
      comparing with ``vllm_config.model_config`` cannot tell them apart.
    - ``extract_hidden_states`` copies the target's ModelConfig (runner "generate") and passes
      the copy, ``speculative_config.draft_model_config``, next to the target's vLLM config.
    - ngram, suffix and custom proposers load nothing; their ``draft_model_config`` is the
      target's own object, which is the target, not a draft.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    if getattr(model_config, "runner_type", None) == "draft":
        return True
    draft = getattr(spec, "draft_model_config", None)
    return draft is not None and model_config is draft and draft is not getattr(spec, "target_model_config", None)


def moe_layers(model) -> list[int | None]:
    """The expert count of each MoE layer of ``model`` (vLLM's FusedMoE, a MoERunner: a module
    whose router takes a capture function; the count sits on its ``routed_experts``), None where
    the layer does not say."""
    return [getattr(getattr(m, "routed_experts", m), "global_num_experts", None) for m in model.modules()
            if callable(getattr(getattr(m, "router", None), "set_capture_fn", None))]


def start_line(model, vllm_config, model_config) -> str:
    """What smoe does with a draft, said once at start."""
    spec = vllm_config.speculative_config
    what = f"smoe: speculative draft {model_config.model} (method {getattr(spec, 'method', '?')}) loaded as vLLM " \
           f"loads it, without smoe's placement, recording or token order"
    counts = moe_layers(model)
    if not counts:
        return what + " (it has no MoE layers)"
    experts = sorted({e for e in counts if e is not None})
    return (what + f"; its {len(counts)} MoE layers ({'/'.join(map(str, experts)) or '?'} experts) are served as "
            f"vLLM serves them: in checkpoint order, not recorded, not swapped live")


def log_draft(model, vllm_config, model_config):
    """The loader's last word on a draft: :func:`start_line` logged; ``model`` returned as loaded."""
    logger.info("%s", start_line(model, vllm_config, model_config))
    return model
