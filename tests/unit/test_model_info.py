"""model_info: which decoder layers route to experts, by the config keys vLLM's models read."""

import pytest

from vllm_smoe.formats.model_info import moe_layer_indices, num_experts, top_k


@pytest.mark.parametrize("cfg, layers", [
    # Mixtral, OLMoE: every layer
    ({"model_type": "mixtral", "num_hidden_layers": 4, "num_local_experts": 8}, [0, 1, 2, 3]),
    # Qwen2/3-MoE: dense layers listed, a sparse step
    ({"model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 1, "mlp_only_layers": [0, 4]},
     [1, 2, 3, 5]),
    ({"model_type": "qwen2_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": []}, [1, 3, 5]),
    # DeepSeek-V2/V3: dense first layers, a frequency
    ({"model_type": "deepseek_v3", "num_hidden_layers": 6, "first_k_dense_replace": 3, "moe_layer_freq": 1}, [3, 4, 5]),
    ({"model_type": "deepseek_v2", "num_hidden_layers": 6, "first_k_dense_replace": 1, "moe_layer_freq": 2}, [2, 4]),
    # GLM-4.5 (glm4_moe) and dots.llm1 read first_k_dense_replace under another model_type
    ({"model_type": "glm4_moe", "num_hidden_layers": 46, "first_k_dense_replace": 3},
     list(range(3, 46))),
    ({"model_type": "dots1", "num_hidden_layers": 4, "first_k_dense_replace": 1}, [1, 2, 3]),
    # Llama 4: every step-th layer (vLLM's Llama4 reads the step, not the config's moe_layers list)
    ({"model_type": "llama4_text", "num_hidden_layers": 6, "interleave_moe_layer_step": 2}, [1, 3, 5]),
    ({"model_type": "llama4_text", "num_hidden_layers": 6, "interleave_moe_layer_step": 1, "moe_layers": [1, 3]},
     [0, 1, 2, 3, 4, 5]),
    # ERNIE 4.5: a first MoE layer, an interval, a last one
    ({"model_type": "ernie4_5_moe", "num_hidden_layers": 6, "moe_layer_start_index": 1, "moe_layer_end_index": 4,
      "moe_layer_interval": 1}, [1, 2, 3, 4]),
    ({"model_type": "ernie4_5_moe", "num_hidden_layers": 6, "moe_layer_start_index": 0, "moe_layer_end_index": -1,
      "moe_layer_interval": 2}, [1, 3, 5]),
    # EXAONE-MoE, Cohere2-MoE: a kind per layer (EXAONE also has first_k_dense_replace; the list wins)
    ({"model_type": "exaone_moe", "num_hidden_layers": 4, "first_k_dense_replace": 1,
      "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}, [1, 3]),
    ({"model_type": "cohere2_moe", "num_hidden_layers": 3, "mlp_layer_types": ["sparse"] * 3}, [0, 1, 2]),
    # Jamba: a period and an offset
    ({"model_type": "jamba", "num_hidden_layers": 8, "expert_layer_period": 2, "expert_layer_offset": 1},
     [1, 3, 5, 7]),
    # LFM2-MoE, AFMoE: dense first layers under another key
    ({"model_type": "lfm2_moe", "num_hidden_layers": 5, "num_dense_layers": 2}, [2, 3, 4]),
    # GPT-OSS, Granite-MoE: every layer; DBRX names its layer count n_layers
    ({"model_type": "gpt_oss", "num_hidden_layers": 3, "num_local_experts": 8}, [0, 1, 2]),
    ({"model_type": "dbrx", "n_layers": 2, "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}, [0, 1]),
])
def test_moe_layers_by_config_keys(cfg, layers):
    assert moe_layer_indices(cfg) == layers


def test_the_transformers_configs_of_the_testbed_agree_with_vllm_models():
    # the testbed's GLM-4.5 checkpoint: one dense layer first (vLLM's Glm4MoeModel counts
    # num_hidden_layers - first_k_dense_replace MoE layers)
    pytest.importorskip("transformers")
    from vllm_smoe.testbed.models import make_config, moe_shape

    assert moe_shape(make_config("glm4_moe", 4096, num_layers=3, num_experts=8, top_k=2)) == dict(
        num_layers=2, num_experts=8, top_k=2)
    for arch in ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe"):
        assert moe_shape(make_config(arch, 4096, num_layers=3, num_experts=8, top_k=2))["num_layers"] == 3, arch


def test_expert_and_top_k_keys():
    assert num_experts({"moe_num_experts": 64}) == 64 and top_k({"moe_k": 6}) == 6
    assert num_experts({"n_routed_experts": 256, "num_experts": None}) == 256
    dbrx = {"n_layers": 2, "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4}}
    assert (num_experts(dbrx), top_k(dbrx)) == (16, 4)
    with pytest.raises(ValueError, match="expert count"):
        num_experts({"hidden_size": 8})
    with pytest.raises(ValueError, match="routed experts per token"):
        top_k({"num_experts": 8})


def test_a_layer_kind_list_counts_first_only_where_vllm_reads_it_first():
    # transformers fills mlp_layer_types in for configs whose vLLM class reads other keys (with
    # kinds such as "moe"): there the other keys decide
    filled = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "first_k_dense_replace": 1,
              "mlp_layer_types": ["dense", "hash_moe", "moe", "moe"]}
    assert moe_layer_indices(filled) == [1, 2, 3]
    assert moe_layer_indices({"model_type": "other", "num_hidden_layers": 3,
                              "mlp_layer_types": ["dense", "sparse", "sparse"]}) == [1, 2]


def test_a_layer_kind_list_smoe_cannot_read_is_refused_by_field():
    with pytest.raises(ValueError, match="'mlp_layer_types'"):
        moe_layer_indices({"num_hidden_layers": 3, "mlp_layer_types": ["dense", "moe", "moe"]})
    with pytest.raises(ValueError, match="'mlp_layer_types'"):
        moe_layer_indices({"model_type": "exaone_moe", "num_hidden_layers": 3, "mlp_layer_types": ["sparse"]})
    with pytest.raises(ValueError, match="decoder layer count"):
        moe_layer_indices({"num_experts": 8})


def test_a_vision_language_config_is_read_at_its_language_model():
    """Llama 4's and Qwen3-VL-MoE's released checkpoints nest the language model's config under
    ``text_config`` (vLLM serves them by ``hf_text_config``); the fingerprint reads it there too."""
    from vllm_smoe.formats.placement_file import model_fingerprint

    llama4 = {"model_type": "llama4", "vision_config": {"num_hidden_layers": 34},
              "text_config": {"model_type": "llama4_text", "num_hidden_layers": 4, "interleave_moe_layer_step": 2,
                              "num_local_experts": 16, "num_experts_per_tok": 1, "hidden_size": 64}}
    assert (moe_layer_indices(llama4), num_experts(llama4), top_k(llama4)) == ([1, 3], 16, 1)
    vl = {"model_type": "qwen3_vl_moe", "text_config": {"num_hidden_layers": 3, "decoder_sparse_step": 1,
                                                         "mlp_only_layers": [0], "num_experts": 8,
                                                         "num_experts_per_tok": 2}}
    assert (moe_layer_indices(vl), num_experts(vl), top_k(vl)) == ([1, 2], 8, 2)
    wider = {**llama4, "text_config": {**llama4["text_config"], "num_local_experts": 128}}
    assert model_fingerprint(wider) != model_fingerprint(llama4)
    flat = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 8}  # unchanged for flat configs
    assert model_fingerprint(flat) == model_fingerprint({**flat, "text_config": {"num_hidden_layers": 9}})
