"""A checkpoint that lists experts vLLM 0.33 replaces by constants (``approximate_experts``, MoNE
pruning) is refused with a placement: vLLM keys the substitution by expert id on the router's
output and in the tensors' names, which a placement renumbers."""

import json
import re
import types

import pytest

from vllm_smoe.serving.place.load_plan import make_load_plan, plan_for
from tests.support import derangement_yaml

_TINY = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2}
_SUBSTITUTION = {"transform_config": {"expert_substitution": {
    "version": 1, "targets": {"model.layers.0.mlp.experts": {"weight_layout": "compact_retained_experts",
                                                             "replacements": {"2": {"format": "constant-v1"}}}}}}}


def _placement(tmp_path):
    return derangement_yaml(tmp_path / "p.yaml", ep=2, layers=1, experts=4, top_k=2)


def test_approximate_experts_refused_naming_the_field_and_checkpoint(tmp_path):
    path = _placement(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path}/model") + ".*'approximate_experts'") as e:
        make_load_plan(path, dict(_TINY, approximate_experts={"0": [1, 3]}), str(tmp_path / "model"), None)
    assert path in str(e.value)
    make_load_plan(path, dict(_TINY, approximate_experts={"0": []}), str(tmp_path), None)  # substitutes nothing


def test_substitution_read_from_the_checkpoint_and_the_whole_config(tmp_path):
    path = _placement(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(_TINY, compression_config=_SUBSTITUTION)))
    with pytest.raises(ValueError, match="'compression_config.transform_config.expert_substitution'"):
        make_load_plan(path, _TINY, str(tmp_path), 2)
    # a vision-language model: the text part is hf_config, the field sits on the whole config
    outer = types.SimpleNamespace(approximate_experts={"0": [2]}, text_config=_TINY)
    mc = types.SimpleNamespace(hf_text_config=_TINY, hf_config=outer, model=str(tmp_path / "hub-id"))
    pc = types.SimpleNamespace(tensor_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False)
    with pytest.raises(ValueError, match="'approximate_experts'"):
        plan_for(path, types.SimpleNamespace(model_config=mc, parallel_config=pc))
    mc.hf_config = types.SimpleNamespace(text_config=_TINY)
    assert plan_for(path, types.SimpleNamespace(model_config=mc, parallel_config=pc)).slot2expert.shape == (1, 4)
