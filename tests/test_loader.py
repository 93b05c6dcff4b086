"""Placement at load, checked against transformers' own implementation of the checkpoint."""

import os
import shutil

import numpy as np
import pytest
import yaml

from vllm_smoe.serving.load_plan import make_load_plan
from vllm_smoe.testbed import FIXTURE_MODEL

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")


def _derangement_yaml(path, shift=1, ep=32, layers=4, experts=32, **model):
    doc = {"smoe_placement": 1, "model": {"num_layers": layers, "num_experts": experts, "top_k": 4, **model},
           "ep_size": ep, "layers": [{"expert_to_rank": [((e + shift + i) % experts) * ep // experts
                                                         for e in range(experts)]} for i in range(layers)]}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_permuted_checkpoint_is_the_same_function(tmp_path):
    """Rename/reorder the fixture's tensors as the loader does, load the result with transformers:
    same logits, and the router now names slots: slot = expert2slot[logical]."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_smoe.serving.loader import permute_weights

    cfg = AutoConfig.from_pretrained(FIXTURE_MODEL)
    plan = make_load_plan(_derangement_yaml(tmp_path / "p.yaml"), cfg, FIXTURE_MODEL, None)
    assert (plan.slot2expert != np.arange(32)).all()  # every expert moved
    with safe_open(os.path.join(FIXTURE_MODEL, "model.safetensors"), "pt") as f:
        weights = [(k, f.get_tensor(k)) for k in f.keys()]
    counts = {}
    permuted = dict(permute_weights(weights, plan, counts))
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


@pytest.mark.parametrize("edit, words", [
    (dict(layers=3), "model.num_layers"),
    (dict(experts=16, ep=16), "model.num_experts"),
    (dict(fingerprint="0123456789abcdef"), "model.fingerprint"),
])
def test_plan_rejects_placements_for_another_model(tmp_path, edit, words):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(FIXTURE_MODEL)
    path = _derangement_yaml(tmp_path / "p.yaml", **edit)
    with pytest.raises(ValueError) as e:
        make_load_plan(path, cfg, FIXTURE_MODEL, None)
    assert path in str(e.value) and words in str(e.value)


def test_plan_checks_ep_size_when_experts_are_split(tmp_path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(FIXTURE_MODEL)
    path = _derangement_yaml(tmp_path / "p.yaml", ep=4)
    make_load_plan(path, cfg, FIXTURE_MODEL, None)  # experts not split: any ep_size
    make_load_plan(path, cfg, FIXTURE_MODEL, 4)
    with pytest.raises(ValueError, match="'ep_size' = 4 but experts are split over 2 ranks"):
        make_load_plan(path, cfg, FIXTURE_MODEL, 2)


def test_grouped_routing_refuses_cross_group_moves(tmp_path):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "first_k_dense_replace": 0, "n_routed_experts": 32,
           "num_experts_per_tok": 4, "n_group": 4}
    path = _derangement_yaml(tmp_path / "p.yaml")
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
