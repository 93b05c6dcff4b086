"""Placement at load, checked against transformers' own implementation of the checkpoint."""

import os
import shutil

import numpy as np
import pytest
import yaml

from vllm_smoe.serving.place.load_plan import make_load_plan
from vllm_smoe.testbed import FIXTURE_MODEL
from tests.support import CONFIGS, derangement_yaml

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def test_permuted_checkpoint_is_the_same_function(tmp_path):
    """Rename/reorder the fixture's tensors as the loader does, load the result with transformers:
    same logits, and the router now names slots: slot = expert2slot[logical]."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_smoe.serving.place.loader import permute_weights

    cfg = AutoConfig.from_pretrained(FIXTURE_MODEL)
    plan = make_load_plan(derangement_yaml(tmp_path / "p.yaml"), cfg, FIXTURE_MODEL, None)
    assert (plan.slot2expert != np.arange(32)).all()  # every expert moved
    with safe_open(os.path.join(FIXTURE_MODEL, "model.safetensors"), "pt") as f:
        weights = [(k, f.get_tensor(k)) for k in f.keys()]
    counts = {}
    permuted = dict(permute_weights(weights, plan, counts=counts))
    assert counts == {"renamed": 4 * 32 * 3, "reordered": 4}
    out = tmp_path / "m"
    os.makedirs(out)
    save_file(permuted, str(out / "model.safetensors"), metadata={"format": "pt"})
    for fn in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(FIXTURE_MODEL, fn), out / fn)
    a = AutoModelForCausalLM.from_pretrained(FIXTURE_MODEL, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    x = torch.tensor([[5, 77, 300, 12, 9, 1000, 42]])
    with torch.no_grad():
        oa, ob = a(x, output_router_logits=True), b(x, output_router_logits=True)
    torch.testing.assert_close(ob.logits, oa.logits, rtol=0, atol=1e-5)  # fp32, same math in another order
    for layer in range(4):
        ia = oa.router_logits[layer].topk(4).indices.numpy()
        ib = ob.router_logits[layer].topk(4).indices.numpy()
        np.testing.assert_array_equal(ib, plan.expert2slot[layer][ia])


def _random_moe(arch, out_dir):
    """A random checkpoint of ``arch`` (3 decoder layers, 8 experts, top-2) whose routers are
    random too: transformers starts some at zero (ERNIE's gate and score bias), where every expert
    ties and a reorder would change the routing by tie-breaks alone. Returns its config."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from vllm_smoe.testbed.models import build_random

    if arch == "ernie4_5_moe":  # not a testbed architecture: its score bias is stored [1, E]
        from transformers import Ernie4_5_MoeConfig

        tok = PreTrainedTokenizerFast.from_pretrained(FIXTURE_MODEL)
        cfg = Ernie4_5_MoeConfig(vocab_size=len(tok), hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=256, moe_intermediate_size=64,
                                 moe_num_experts=8, moe_k=2, moe_layer_start_index=1, moe_layer_interval=1,
                                 moe_num_shared_experts=1, tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    elif arch == "qwen3_vl_moe":  # a vision-language checkpoint: the language model under text_config
        from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

        tok = PreTrainedTokenizerFast.from_pretrained(FIXTURE_MODEL)
        text = dict(vocab_size=len(tok), hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=256, moe_intermediate_size=64,
                    num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6],
                                     "mrope_interleaved": True})
        vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                      deepstack_visual_indexes=[])
        cfg = Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
        torch.manual_seed(0)
        Qwen3VLMoeForConditionalGeneration._from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    else:
        build_random(arch, out_dir, FIXTURE_MODEL, num_layers=3, num_experts=8, top_k=2)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    g = torch.Generator().manual_seed(1)
    for k in tensors:
        if k.endswith(("mlp.gate.weight", "e_score_correction_bias", "router.weight", "router.bias",
                       "router.layer.weight")):
            tensors[k] = torch.randn(tensors[k].shape, generator=g) * 0.5
    save_file(tensors, path, metadata={"format": "pt"})
    return AutoConfig.from_pretrained(out_dir)


@pytest.mark.parametrize("arch, moe_layers, renamed, reordered", [
    ("glm4_moe", 2, 2 * 8 * 3, 4),  # router weight and score bias [E] per MoE layer; layer 0 dense
    ("ernie4_5_moe", 2, 2 * 8 * 3, 4),  # the score bias in moe_statics, [1, E]
    ("qwen2_moe", 3, 3 * 8 * 3, 3),  # the shared expert's gate has one row: left alone
    ("exaone_moe", 2, 2 * 8 * 3, 4),  # the score bias straight under the block; layer 0 dense (a kind list)
    ("gpt_oss", 3, 0, 3 * 6),  # router weight and bias, stacked experts and their biases
    ("granitemoe", 3, 0, 3 * 3),  # router.layer, input_linear / output_linear stacked
    ("qwen3_vl_moe", 3, 0, 3 * 3),  # stacked experts under model.language_model, the config under text_config
])
def test_permuted_checkpoint_of_other_architectures_is_the_same_function(tmp_path, arch, moe_layers, renamed,
                                                                         reordered):
    """As above, for architectures with a score bias or a shared expert beside the router."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from vllm_smoe.formats.model_info import moe_layer_indices
    from vllm_smoe.serving.place.loader import permute_weights

    src = str(tmp_path / "src")
    cfg = _random_moe(arch, src)
    assert len(moe_layer_indices(cfg)) == moe_layers
    plan = make_load_plan(derangement_yaml(tmp_path / "p.yaml", ep=8, layers=moe_layers, experts=8, step=3,
                                           top_k=2), cfg, src, None)
    counts = {}
    permuted = dict(permute_weights(load_file(os.path.join(src, "model.safetensors")).items(), plan, counts=counts))
    assert counts == ({"renamed": renamed} if renamed else {}) | {"reordered": reordered}
    out = tmp_path / "m"
    os.makedirs(out)
    save_file(permuted, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(src, "config.json"), out / "config.json")
    auto = AutoModelForCausalLM
    if arch == "qwen3_vl_moe":
        from transformers import AutoModelForImageTextToText as auto
    a = auto.from_pretrained(src, dtype=torch.float32).eval()
    b = auto.from_pretrained(str(out), dtype=torch.float32).eval()
    x = torch.tensor([[5, 77, 300, 12, 9, 1000, 42, 7, 8, 2000]])
    with torch.no_grad():
        la, lb = a(x).logits, b(x).logits
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-5)
    c = auto.from_pretrained(src, dtype=torch.float32).eval()  # the bias left in checkpoint order
    c.load_state_dict({k: v for k, v in b.state_dict().items() if not k.endswith(("correction_bias", "router.bias"))},
                      strict=False)
    if arch not in ("qwen2_moe", "granitemoe", "qwen3_vl_moe"):
        with torch.no_grad():
            assert not torch.allclose(c(x).logits, la, atol=1e-5)  # so the bias's order is what the test checks


def test_an_unknown_per_expert_tensor_is_refused_not_left_in_order(tmp_path):
    """A tensor of an MoE layer's block with an extent of E that is neither an expert's, the
    router's nor a shared expert's is refused by name (it would keep checkpoint order)."""
    from vllm_smoe.serving.place.loader import permute_weights

    plan = make_load_plan(derangement_yaml(tmp_path / "p.yaml", ep=4, layers=1, experts=4, top_k=2), _TINY,
                          str(tmp_path), None)
    fine = [("model.layers.0.mlp.gate.weight", torch.zeros(4, 8)), ("model.layers.0.mlp.router.bias", torch.zeros(4)),
            ("model.layers.0.mlp.moe_statics.e_score_correction_bias", torch.arange(4.0)[None]),
            ("model.layers.0.mlp.shared_expert.up_proj.weight", torch.zeros(4, 8)),
            ("model.layers.0.mlp.shared_expert_gate.weight", torch.zeros(1, 8)),
            ("model.layers.1.mlp.gate_proj.weight", torch.zeros(4, 8)),  # no MoE layer 1 in this plan
            ("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 8)),
            ("vision_model.model.layers.0.mlp.fc1.weight", torch.zeros(4, 8))]  # Llama 4's vision tower
    got = dict(permute_weights(fine, plan))
    assert got["model.layers.0.mlp.moe_statics.e_score_correction_bias"][0].tolist() == \
        plan.slot2expert[0].astype(float).tolist()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.expert_scale \(shape \(4, 16\)\)"):
        list(permute_weights([("model.layers.0.mlp.expert_scale", torch.zeros(4, 16))], plan))


def test_a_checkpoint_naming_its_router_or_experts_otherwise_is_refused(tmp_path):
    """Every MoE layer must have had its router weight and its experts put in order; a checkpoint
    that names them in a way smoe does not know (DBRX's ``transformer.blocks.<i>.ffn``) is refused
    at the end of the stream, naming the layer, rather than served half placed."""
    from vllm_smoe.serving.place.loader import check_covered, permute_weights

    plan = make_load_plan(derangement_yaml(tmp_path / "p.yaml", ep=4, layers=1, experts=4, top_k=2), _TINY,
                          str(tmp_path), None)
    router = ("model.layers.0.mlp.gate.weight", torch.zeros(4, 8))
    experts = [(f"model.layers.0.mlp.experts.{e}.down_proj.weight", torch.zeros(2, 2)) for e in range(4)]
    for stream, missing in (([router] + experts, None), (experts, "router weight"), ([router], "experts"),
                            ([("transformer.blocks.0.ffn.router.layer.weight", torch.zeros(4, 8))], "router weight")):
        covered = np.zeros((1, 2), dtype=bool)
        list(permute_weights(stream, plan, covered=covered))
        if missing is None:
            check_covered(plan, covered)
        else:
            with pytest.raises(ValueError, match=f"no {missing} of decoder layer 0"):
                check_covered(plan, covered)


@pytest.mark.parametrize("edit, words", [
    (dict(layers=3), "model.num_layers"),
    (dict(experts=16, ep=16), "model.num_experts"),
    (dict(fingerprint="0123456789abcdef"), "model.fingerprint"),
])
def test_plan_rejects_placements_for_another_model(tmp_path, edit, words):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(FIXTURE_MODEL)
    path = derangement_yaml(tmp_path / "p.yaml", **edit)
    with pytest.raises(ValueError) as e:
        make_load_plan(path, cfg, FIXTURE_MODEL, None)
    assert path in str(e.value) and words in str(e.value)


def test_plan_checks_ep_size_when_experts_are_split(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(FIXTURE_MODEL)
    path = derangement_yaml(tmp_path / "p.yaml", ep=4)
    make_load_plan(path, cfg, FIXTURE_MODEL, None)  # experts not split: any ep_size
    make_load_plan(path, cfg, FIXTURE_MODEL, 4)
    with pytest.raises(ValueError, match="'ep_size' = 4 but experts are split over 2 ranks"):
        make_load_plan(path, cfg, FIXTURE_MODEL, 2)


def test_grouped_routing_refuses_cross_group_moves(tmp_path):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 0, "n_routed_experts": 32,
           "num_experts_per_tok": 4, "n_group": 4}
    path = derangement_yaml(tmp_path / "p.yaml")
    with pytest.raises(ValueError, match="routing group"):
        make_load_plan(path, cfg, str(tmp_path), None)
    # each group of 8 whole on its own rank is fine
    inside = {"smoe_placement": 1, "model": {"num_layers": 4, "num_experts": 32, "top_k": 4}, "ep_size": 4,
              "layers": [{"expert_to_rank": [e // 8 for e in range(32)]} for _ in range(4)]}
    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(inside))
    make_load_plan(str(tmp_path / "ok.yaml"), cfg, str(tmp_path), None)
    # whole groups trade places (group scores are symmetric in the groups): fine too
    swapped = [[(3 - e // 8) if layer % 2 else [1, 0, 3, 2][e // 8] for e in range(32)] for layer in range(4)]
    inside["layers"] = [{"expert_to_rank": row} for row in swapped]
    (tmp_path / "swap.yaml").write_text(yaml.safe_dump(inside))
    plan = make_load_plan(str(tmp_path / "swap.yaml"), cfg, str(tmp_path), 4)
    assert plan.expert2slot[1, 0] == 24 and plan.expert2slot[0, 8] == 0
    # two groups per rank at EP 2: any pairing of whole groups
    inside.update(ep_size=2, layers=[{"expert_to_rank": [[0, 1, 1, 0][e // 8] for e in range(32)]}] * 4)
    (tmp_path / "pair.yaml").write_text(yaml.safe_dump(inside))
    make_load_plan(str(tmp_path / "pair.yaml"), cfg, str(tmp_path), 2)
    # one group over two ranks at EP 8, split any way inside the group; but not across groups
    rows = [[(e // 8) * 2 + (e % 2) for e in range(32)], [(e // 8) * 2 + (e % 8 >= 4) for e in range(32)]]
    rows[1][3], rows[1][12] = rows[1][12], rows[1][3]
    inside.update(ep_size=8, layers=[{"expert_to_rank": rows[0]}] * 4)
    (tmp_path / "split.yaml").write_text(yaml.safe_dump(inside))
    make_load_plan(str(tmp_path / "split.yaml"), cfg, str(tmp_path), 8)
    inside["layers"] = [{"expert_to_rank": rows[0]}] * 3 + [{"expert_to_rank": rows[1]}]
    (tmp_path / "cross.yaml").write_text(yaml.safe_dump(inside))
    with pytest.raises(ValueError, match=r"layers\[3\].expert_to_rank' splits expert \d+'s routing group"):
        make_load_plan(str(tmp_path / "cross.yaml"), cfg, str(tmp_path), 8)


def _replica_yaml(path, layers=4):
    """4 experts on 2 ranks (0, 2 on rank 0; 1, 3 on rank 1), expert 1 copied to rank 0."""
    doc = {"smoe_placement": 1, "model": {"num_layers": layers, "num_experts": 4, "top_k": 2}, "ep_size": 2,
           "layers": [{"expert_to_rank": [0, 1, 0, 1], "replicas": [[1, 0]]} for _ in range(layers)]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


_TINY = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 4, "num_experts_per_tok": 2}


def test_replica_layout_golden(tmp_path):
    """Router order [0, 2 | 1, 3]; one copy per rank at most, so 3 slots per rank: rank 0 holds
    0, 2 and the copy of 1; rank 1 holds 1, 3 and a filler (its first home expert, 1)."""
    plan = make_load_plan(_replica_yaml(tmp_path / "r.yaml", 1), _TINY, str(tmp_path), 2)
    np.testing.assert_array_equal(plan.slot2expert, [[0, 2, 1, 3]])
    np.testing.assert_array_equal(plan.physical2expert, [[0, 2, 1, 1, 3, 1]])
    np.testing.assert_array_equal(plan.route2physical, [[[0, 1, 2, 4], [0, 1, 3, 4]]])  # rank 0: its copy of 1
    assert plan.num_redundant == 2 and plan.local_slots(1) == range(3, 6)
    np.testing.assert_array_equal(plan.held(0), [[True, True, True, False]])
    np.testing.assert_array_equal(plan.held(1), [[False, False, True, True]])
    with pytest.raises(ValueError, match="copies need experts split over ranks"):
        make_load_plan(_replica_yaml(tmp_path / "r.yaml", 1), _TINY, str(tmp_path), None)


def test_replica_layout_routes_every_rank_to_the_same_experts():
    """Fixture EP 2 with 4 copies: whatever rank routes, router output i reaches logical expert
    slot2expert[i]; the rank's own copies are used; every rank holds P / N slots."""
    from transformers import AutoConfig

    plan = make_load_plan(os.path.join(CONFIGS, "tiny-4dom-ep2-r4.yaml"), AutoConfig.from_pretrained(FIXTURE_MODEL),
                          FIXTURE_MODEL, 2)
    L, P = plan.physical2expert.shape
    assert P == 36 and plan.route2physical.shape == (L, 2, 32)
    for rank in range(2):
        for layer in range(L):
            np.testing.assert_array_equal(plan.physical2expert[layer, plan.route2physical[layer, rank]],
                                          plan.slot2expert[layer])
        own = plan.route2physical[:, rank] // (P // 2) == rank
        np.testing.assert_array_equal(own, plan.held(rank))
        assert own.sum(axis=1).tolist() == [18] * L  # 16 home experts + 2 copies per layer


def test_slot_names_are_vllms_initial_redundant_layout():
    from vllm.distributed.eplb.eplb_state import EplbState

    from vllm_smoe.serving.place.load_plan import initial_physical_names

    for E, R in [(4, 2), (32, 4), (8, 20)]:
        assert initial_physical_names(E, E + R).tolist() == list(
            EplbState.build_initial_global_physical_to_logical_map(E, R))


def test_each_rank_loads_its_own_slots(tmp_path):
    """With replicas a rank receives, under each slot's name, exactly the expert its slot holds."""
    from vllm_smoe.serving.place.load_plan import initial_physical_names
    from vllm_smoe.serving.place.loader import permute_weights

    plan = make_load_plan(_replica_yaml(tmp_path / "r.yaml", 1), _TINY, str(tmp_path), 2)
    weights = [(f"model.layers.0.mlp.experts.{e}.down_proj.weight", torch.full((2, 2), float(e))) for e in range(4)]
    names = initial_physical_names(4, 6)
    for rank in range(2):
        got = dict(permute_weights(weights, plan, plan.local_slots(rank)))
        want = {f"model.layers.0.mlp.experts.{names[p]}.down_proj.weight": plan.physical2expert[0, p]
                for p in plan.local_slots(rank)}
        assert sorted(got) == sorted(want)
        for name, expert in want.items():
            assert float(got[name][0, 0]) == expert
    stacked = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 2, 2))]
    with pytest.raises(ValueError, match="stacked in one tensor cannot take replicas"):
        list(permute_weights(stacked, plan, plan.local_slots(0)))


def test_cpu_eplb_map_golden():
    """vLLM's map-and-record semantics: replica = Knuth hash of the token index mod count."""
    from vllm_smoe.serving.exchange.cpu_ep import map_to_physical

    l2p = torch.tensor([[5, -1], [3, 7]])
    count = torch.tensor([1, 2])
    ids = torch.tensor([[0, 1], [1, 0], [1, -1]], dtype=torch.int32)
    load = torch.zeros(8, dtype=torch.int32)
    # token 1: 2654435769 % 2 = 1; token 2: (2 * 2654435769) & 0xFFFFFFFF = 1013904242, even
    out = map_to_physical(ids, load, l2p, count, torch.tensor(True), torch.tensor(2))
    assert out.dtype == torch.int32 and out.tolist() == [[5, 3], [7, 5], [3, -1]]
    assert load.tolist() == [0, 0, 0, 1, 0, 2, 0, 1]  # token 2 is padding
    map_to_physical(ids, load, l2p, count, torch.tensor(False))
    assert load.sum() == 4  # recording off


def test_router_takes_the_routes_through_vllms_eplb_seam():
    """vLLM's own router, with smoe's route in its EPLB layer state, returns the physical slots."""
    from vllm.distributed.eplb.eplb_state import EplbLayerState
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from vllm_smoe.serving.patches.cpu import fix_cpu_eplb_map
    from vllm_smoe.serving.place.loader import set_route

    fix_cpu_eplb_map()
    torch.manual_seed(0)
    E, K, T = 8, 2, 11
    router = CPURouter(top_k=K, global_num_experts=E + 2, eplb_state=EplbLayerState())
    route = np.array([0, 1, 8, 3, 4, 9, 6, 7])
    set_route(router, route, E + 2, "cpu")
    x, logits = torch.randn(T, 16), torch.randn(T, E)
    w, ids = router.select_experts(x, logits)
    want = torch.topk(logits.softmax(-1), K).indices
    assert torch.equal(ids.long().sort(1).values, torch.as_tensor(route)[want].sort(1).values)
    assert (ids >= E).any()  # some rows reach the redundant slots
    with pytest.raises(ValueError, match="no EPLB layer state"):
        set_route(CPURouter(top_k=K, global_num_experts=E), route, E + 2, "cpu")


def test_routes_refuse_a_layout_vllm_did_not_build():
    from types import SimpleNamespace as NS

    from vllm_smoe.serving.place.loader import _check_slots

    def runner(P, local, fused=0, naive=False):
        return NS(routed_experts=NS(global_num_experts=P, local_num_experts=local,
                                    expert_map_manager=NS(num_fused_shared_experts=fused)),
                  do_naive_dispatch_combine=naive)

    _check_slots(runner(36, 18), 0, 36, 2)
    for bad, words in [(runner(32, 16), "32 expert slots"), (runner(36, 18, fused=1), "fuses shared experts"),
                       (runner(36, 18, naive=True), "gathers every rank's rows")]:
        with pytest.raises(ValueError, match=words):
            _check_slots(bad, 3, 36, 2)
