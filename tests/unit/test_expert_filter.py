"""Each rank reads only the expert tensors its placement gives it: vLLM's EP weight filter fed, per
MoE layer, the checkpoint ids of the rank's placed slots (copies included), and the bytes a rank
read, counted as they pass."""

import logging
import os
import types

import numpy as np
import pytest

from vllm_smoe.serving.place.expert_filter import PlacedExperts, ReadTally, placed_experts, should_skip
from vllm_smoe.serving.place.load_plan import LoadPlan, _physical_layout
from tests.support import CONFIGS

torch = pytest.importorskip("torch")


def _plan(expert2rank, ep, replicas=None, moe_layers=None):
    """A stand-in load plan from home ranks [L][E] and copies [L][R] (expert, rank)."""
    e2r = np.asarray(expert2rank)
    L, _ = e2r.shape
    reps = np.full((L, 1, 2), -1) if replicas is None else np.asarray(replicas)
    slot2expert = np.argsort(e2r, axis=1, kind="stable")
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable")
    physical2expert, route2physical = _physical_layout(e2r, reps, ep, expert2slot)
    return LoadPlan(tuple(moe_layers or range(L)), slot2expert, expert2slot, physical2expert, route2physical)


def _homes(e2r, layer, rank):
    return {e for e, r in enumerate(e2r[layer]) if r == rank}


def test_each_rank_reads_its_home_experts_per_layer():
    e2r = [[0, 1, 1, 0, 1, 0, 0, 1], [1, 0, 0, 1, 0, 1, 1, 0]]  # each rank holds every expert in some layer
    plan = _plan(e2r, 2)
    for rank in range(2):
        got = plan.local_experts(rank)
        assert got == [_homes(e2r, layer, rank) for layer in range(2)]
        assert PlacedExperts(got, plan.moe_layers) == set(range(8))  # vLLM's one set for all layers: skips nothing
    assert plan.local_experts(0)[0].isdisjoint(plan.local_experts(1)[0])


def test_an_uneven_split_reads_what_vllms_split_holds():
    """10 experts over 4 ranks: vLLM's linear split gives 3, 3, 2, 2 slots; the placement's ranks hold those."""
    e2r = [[2, 0, 1, 3, 0, 1, 0, 3, 1, 2], [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]]
    plan = _plan(e2r, 4)
    for rank in range(4):
        assert plan.local_experts(rank) == [_homes(e2r, layer, rank) for layer in range(2)]
    assert [len(plan.local_experts(r)[0]) for r in range(4)] == [3, 3, 2, 2]
    vllm_filter = pytest.importorskip("vllm.model_executor.model_loader.ep_weight_filter")
    assert [len(vllm_filter.compute_local_expert_ids(10, 4, r)) for r in range(4)] == [3, 3, 2, 2]


def test_copies_are_read_by_the_rank_that_holds_them():
    """Layer 0: rank 0 holds copies of 1 and 3, rank 1 a copy of 0; layer 1 one copy (fillers add nothing)."""
    e2r = [[0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 0, 0, 1, 1, 0, 0]]
    replicas = [[[1, 0], [3, 0], [0, 1]], [[0, 0], [-1, -1], [-1, -1]]]
    plan = _plan(e2r, 2, replicas)
    assert plan.num_redundant == 4
    assert plan.local_experts(0) == [{0, 2, 4, 6, 1, 3}, {2, 3, 6, 7, 0}]
    assert plan.local_experts(1) == [{1, 3, 5, 7, 0}, {0, 1, 4, 5}]


_HEAVY = (".weight", ".weight_packed")


def _fake_vllm(name, ids):  # vLLM's rule: only heavy per-expert tensors are ever skipped
    import re

    m = re.search(r"\.experts\.(\d+)\.", name)
    return bool(ids is not None and m and name.endswith(_HEAVY) and int(m[1]) not in ids)


def test_only_heavy_tensors_of_experts_on_other_ranks_are_skipped():
    plan = _plan([[0, 1, 0, 1], [1, 0, 1, 0]], 2, moe_layers=(1, 3))  # decoder layers 0 and 2 dense
    ids = PlacedExperts(plan.local_experts(0), plan.moe_layers)  # layer 1: {0, 2}; layer 3: {1, 3}
    skipped = {
        "model.layers.1.mlp.experts.1.down_proj.weight": True,
        "model.layers.1.mlp.experts.2.down_proj.weight": False,
        "model.layers.3.mlp.experts.2.gate_proj.weight_packed": True,
        "model.layers.3.mlp.experts.1.gate_proj.weight": False,
        "model.layers.1.mlp.experts.1.down_proj.weight_scale": False,  # scales: vLLM keeps them all
        "model.layers.5.mlp.experts.1.down_proj.weight": False,  # not a placed layer (MTP, a draft's)
        "model.experts.1.down_proj.weight": False,  # no layer: smoe does not place it
        "model.layers.1.mlp.shared_experts.down_proj.weight": False,
        "model.layers.1.mlp.gate.weight": False,
        "model.layers.1.mlp.experts.gate_up_proj": False,  # stacked: read whole, sliced by vLLM
    }
    assert {n: should_skip(n, ids, _fake_vllm) for n in skipped} == skipped
    # any other set is vLLM's business
    assert should_skip("model.layers.1.mlp.experts.1.down_proj.weight", {0}, _fake_vllm) is True
    assert should_skip("model.layers.1.mlp.experts.1.down_proj.weight", None, _fake_vllm) is False


def test_vllms_own_rule_decides_what_is_heavy():
    vllm_filter = pytest.importorskip("vllm.model_executor.model_loader.ep_weight_filter")
    plan = _plan([[0, 1, 0, 1]], 2)
    ids = PlacedExperts(plan.local_experts(0), plan.moe_layers)
    skip = [n for n in ("model.layers.0.mlp.experts.1.w1.weight", "model.layers.0.mlp.experts.1.w1.weight_packed",
                        "model.layers.0.mlp.experts.1.w1.input_scale", "model.layers.0.mlp.experts.0.w1.weight")
            if should_skip(n, ids, vllm_filter.should_skip_weight)]
    assert skip == ["model.layers.0.mlp.experts.1.w1.weight", "model.layers.0.mlp.experts.1.w1.weight_packed"]


@pytest.mark.parametrize("replicas", [None, [[[1, 0], [0, 1]], [[0, 0], [1, 1]]]])
def test_every_rank_still_gets_every_tensor_its_slots_hold(replicas):
    """The filtered stream, renamed as the loader does, hands each of the rank's slots the same
    tensors as the whole checkpoint (what vLLM's expert map keeps of it)."""
    from vllm_smoe.serving.place.loader import permute_weights

    plan = _plan([[0, 1, 1, 0], [1, 0, 0, 1]], 2, replicas)
    weights = [(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight", torch.full((2,), 10.0 * layer + e))
               for layer in range(2) for e in range(4) for p in ("gate_proj", "down_proj")]
    weights += [("model.layers.0.mlp.gate.weight", torch.zeros(4, 2)), ("model.layers.1.mlp.gate.weight",
                                                                        torch.zeros(4, 2))]
    for rank in range(2):
        slots = plan.local_slots(rank) if plan.num_redundant else None
        ids = PlacedExperts(plan.local_experts(rank), plan.moe_layers)
        read = [(n, t) for n, t in weights if not should_skip(n, ids, _fake_vllm)]
        assert len(read) < len(weights)

        def kept(stream):  # what the rank's slots take (vLLM drops other slots' names; with copies
            out = {}       # the loader names only this rank's slots)
            for n, t in permute_weights(stream, plan, slots):
                m = n.split(".experts.")
                if len(m) == 1 or slots is not None or int(m[1].split(".")[0]) in plan.local_slots(rank):
                    out[n] = t.tolist()
            return out

        assert kept(read) == kept(weights)


def test_vllm_config_decides_whether_to_filter():
    plan = _plan([[0, 1]], 2)
    assert placed_experts(plan, 0, _pc(flag=False)) is None  # vLLM's opt-in, kept
    assert placed_experts(plan, 0, _pc(ep=False)) is None


def _fixture_plan(ep=2):
    from transformers import AutoConfig

    from vllm_smoe.serving.place.load_plan import make_load_plan
    from vllm_smoe.testbed import FIXTURE_MODEL

    path = os.path.join(CONFIGS, "tiny-4dom-ep2.yaml")
    return make_load_plan(path, AutoConfig.from_pretrained(FIXTURE_MODEL), FIXTURE_MODEL, ep)


def test_vllms_iterator_reads_half_the_fixtures_experts_per_rank_at_ep2():
    """The fixture and configs/tiny-4dom-ep2.yaml through vLLM's own safetensors iterator: each rank
    reads its 16 of 32 experts per layer, half the expert bytes, and the two ranks read each once."""
    pytest.importorskip("vllm")
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    from vllm_smoe.serving import patches
    from vllm_smoe.serving.place.loader import _FUSED
    from vllm_smoe.testbed import FIXTURE_MODEL

    plan = _fixture_plan()
    files = [os.path.join(FIXTURE_MODEL, "model.safetensors")]
    on = _pc()
    whole = ReadTally(plan, _FUSED)
    for _ in whole.count(safetensors_weights_iterator(files, False)):
        pass
    assert len(whole.experts) == 4 * 32 and whole.bytes > 0.7 * whole.total  # experts: most of it
    assert whole.total > 0.99 * os.path.getsize(files[0])
    per_rank = []
    for rank in range(2):
        ids = placed_experts(plan, rank, on)
        assert len(ids) >= 28  # one set for every layer (their union: 29, 30 here) would skip almost nothing
        tally = ReadTally(plan, _FUSED)
        names = [n for n, _ in tally.count(safetensors_weights_iterator(files, False, local_expert_ids=ids))]
        assert len(tally.experts) == 4 * 16 and tally.bytes == whole.bytes // 2
        assert tally.total == whole.total - whole.bytes // 2
        assert "model.embed_tokens.weight" in names and "model.layers.0.mlp.gate.weight" in names
        per_rank.append(tally.experts)
    assert per_rank[0].isdisjoint(per_rank[1]) and per_rank[0] | per_rank[1] == whole.experts
    assert "weight_utils_should_skip_weight" in patches.applied()


def test_the_read_line_names_the_bytes_and_experts():
    from vllm_smoe.serving.place.loader import _FUSED

    plan = _plan([[0, 1, 0, 1], [1, 1, 0, 0]], 2, moe_layers=(0, 1))
    tally = ReadTally(plan, _FUSED)
    weights = [("model.layers.0.mlp.experts.2.down_proj.weight", torch.zeros(250_000)),  # 1 MB
               ("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(4, 125_000)),  # 2 MB, every expert
               ("model.layers.0.mlp.gate.weight", torch.zeros(4, 1000)),
               ("model.layers.7.mlp.experts.0.down_proj.weight", torch.zeros(1000))]  # not a placed layer
    assert [n for n, _ in tally.count(weights)] == [n for n, _ in weights]
    ids = PlacedExperts(plan.local_experts(1), plan.moe_layers)
    assert tally.line(1, ids) == ("smoe: rank 1 read 3.00 MB of expert weights (5 of 8 experts over 2 MoE layers), "
                                  "3.02 MB in all; vLLM's EP weight filter skipped the others, fed this rank's "
                                  "placed slots")
    assert "pass --enable-ep-weight-filter" in tally.line(0, None)


def _loader(monkeypatch, plan, rank, flag=True, ep=True):
    pytest.importorskip("vllm")
    import vllm.config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from vllm_smoe.serving.place.loader import SmoeModelLoader

    pc = _pc(ep=ep, flag=flag)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config", lambda: types.SimpleNamespace(parallel_config=pc))
    # vLLM's own: its linear split of checkpoint ids, one set for every layer
    monkeypatch.setattr(DefaultModelLoader, "_init_ep_weight_filter",
                        lambda self, mc: setattr(self, "local_expert_ids", {0, 1} if flag and ep else None))
    monkeypatch.setattr(SmoeModelLoader, "_ep_rank", staticmethod(lambda: rank))
    loader = SmoeModelLoader.__new__(SmoeModelLoader)
    loader.plan, loader.gate_rows, loader.local_expert_ids = plan, None, None
    loader._init_ep_weight_filter(None)
    return loader


def test_the_loader_feeds_vllms_filter_the_placed_slots(monkeypatch, caplog):
    plan = _plan([[0, 1, 1, 0], [1, 0, 0, 1]], 2)
    loader = _loader(monkeypatch, plan, 1)
    assert isinstance(loader.local_expert_ids, PlacedExperts)
    assert list(loader.local_expert_ids.per_layer) == [{1, 2}, {0, 3}]
    assert _loader(monkeypatch, plan, 1, flag=False).local_expert_ids is None
    assert _loader(monkeypatch, plan, 1, ep=False).local_expert_ids is None

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    weights = [(f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight", torch.zeros(1000))
               for layer in range(2) for e in range(4)]
    weights += [(f"model.layers.{layer}.mlp.gate.weight", torch.zeros(4, 2)) for layer in range(2)]
    loader = _loader(monkeypatch, plan, 1)
    ids = loader.local_expert_ids
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights",
                        lambda self, mc, m: iter([(n, t) for n, t in weights if not should_skip(n, ids, _fake_vllm)]))
    with caplog.at_level(logging.INFO, logger="vllm.smoe"):
        list(loader.get_all_weights(None, None))
    assert ("smoe: rank 1 read 0.02 MB of expert weights (4 of 8 experts over 2 MoE layers), 0.02 MB in all; "
            "vLLM's EP weight filter skipped the others, fed this rank's placed slots") in caplog.text



def _pc(ep=True, flag=True, tp=2, dp=1):
    """A parallel config as vLLM's filter reads it: expert parallelism over tp x dp ranks."""
    return types.SimpleNamespace(enable_expert_parallel=ep, enable_ep_weight_filter=flag, tensor_parallel_size=tp,
                                 data_parallel_size=dp, prefill_context_parallel_size=1)


_QUANT = ("gate_proj.weight", "gate_proj.weight_scale", "down_proj.weight", "down_proj.weight_scale")


def _expert_weights(E, layers, parts=_QUANT):
    return [(f"model.layers.{layer}.mlp.experts.{e}.{p}", torch.zeros(1)) for layer in layers for e in range(E)
            for p in parts]


def _read(plan, weights, ids, skip=None):
    from vllm_smoe.serving.place.loader import _FUSED

    tally = ReadTally(plan, _FUSED)
    skip = skip or (lambda n: should_skip(n, ids, _fake_vllm))
    for _ in tally.count((n, t) for n, t in weights if not skip(n)):
        pass
    return tally


def test_a_slot_whose_expert_was_not_read_is_refused_naming_it():
    """vLLM's linear split in force instead of the placement's slots (an attribute vLLM renamed, say):
    the rank's scales pass (vLLM never skips them), its placed experts' weights do not; one expert a
    layer read would satisfy check_covered. Refused after the read, naming the first empty slot."""
    plan = _plan([[1, 1, 0, 0], [0, 1, 1, 0]], 2)  # rank 0: layer 0 experts {2, 3} (slots 0, 1); layer 1 {0, 3}
    weights = _expert_weights(4, range(2))
    tally = _read(plan, weights, {0, 1})  # vLLM's linear split for rank 0
    with pytest.raises(ValueError, match=r"rank 0's slot 0 of decoder layer 0 \(an MoE layer\) holds expert 2, but "
                                         r"model\.layers\.0\.mlp\.experts\.2\.down_proj\.weight, "
                                         r"model\.layers\.0\.mlp\.experts\.2\.gate_proj\.weight were not read.*"
                                         r"3 of its 4 \(MoE layer, slot\) pairs"):
        tally.check_slots(plan.local_slots(0), 0)
    unquantized = [(n, t) for n, t in weights if n.endswith(".weight")]
    with pytest.raises(ValueError, match=r"slot 0 of decoder layer 0 .* holds expert 2, but no tensor of it was read"):
        _read(plan, unquantized, {0, 1}).check_slots(plan.local_slots(0), 0)
    for rank in range(2):  # the placement's own filter, and none: every slot full
        _read(plan, weights, placed_experts(plan, rank, _pc())).check_slots(plan.local_slots(rank), rank)
        _read(plan, weights, None).check_slots(plan.local_slots(rank), rank)


@pytest.mark.parametrize("e2r, ep, replicas", [
    ([[0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 0, 0, 1, 1, 0, 0]], 2,
     [[[1, 0], [3, 0], [0, 1]], [[0, 0], [-1, -1], [-1, -1]]]),  # copies and fillers (as above)
    ([[2, 0, 1, 3, 0, 1, 0, 3, 1, 2], [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]], 4, None),  # 10 experts over 4 ranks: 3, 3, 2, 2
])
def test_every_slot_is_full_with_copies_and_uneven_splits(e2r, ep, replicas):
    plan = _plan(e2r, ep, replicas)
    E = plan.slot2expert.shape[1]
    weights = _expert_weights(E, range(2))
    for rank in range(ep):
        slots = plan.local_slots(rank)
        _read(plan, weights, placed_experts(plan, rank, _pc(tp=ep))).check_slots(slots, rank)
        _read(plan, weights, None).check_slots(slots, rank)
        # the last slot's expert skipped (a copy, a filler): refused, though its home rank read it
        layer = 0
        e = int(plan.physical2expert[layer, slots[-1]])
        p = min(q for q in slots if plan.physical2expert[layer, q] == e)  # the first slot holding it
        gone = _read(plan, weights, None, skip=lambda n: n.startswith(f"model.layers.{layer}.mlp.experts.{e}.")
                     and n.endswith(".weight"))
        with pytest.raises(ValueError, match=rf"slot {p} of decoder layer {layer} .* holds expert {e}, but"):
            gone.check_slots(slots, rank)


def test_stacked_experts_fill_every_slot():
    plan = _plan([[0, 1, 0, 1]], 2)
    weights = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(4, 2)),
               ("model.layers.0.mlp.experts.down_proj", torch.zeros(4, 2))]
    _read(plan, weights, placed_experts(plan, 1, _pc())).check_slots(plan.local_slots(1), 1)
    with pytest.raises(ValueError, match="no tensor of it was read"):
        _read(plan, [], None).check_slots(plan.local_slots(1), 1)


def test_the_loader_refuses_a_rank_whose_slots_vllms_filter_left_empty(monkeypatch):
    """The loader's stream, filtered by vLLM's linear split (as if vLLM no longer read the attribute
    smoe sets): the read raises once the checkpoint has streamed, naming the empty slot."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    plan = _plan([[1, 1, 0, 0], [0, 1, 1, 0]], 2)
    weights = _expert_weights(4, range(2)) + [(f"model.layers.{layer}.mlp.gate.weight", torch.zeros(4, 2))
                                              for layer in range(2)]
    loader = _loader(monkeypatch, plan, 0)
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights",
                        lambda self, mc, m: iter([(n, t) for n, t in weights if not _fake_vllm(n, {0, 1})]))
    with pytest.raises(ValueError, match=r"rank 0's slot 0 of decoder layer 0 \(an MoE layer\) holds expert 2"):
        list(loader.get_all_weights(None, None))
    # the placement's set in force, or no filter at all: loads
    ids = loader.local_expert_ids
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights",
                        lambda self, mc, m: iter([(n, t) for n, t in weights if not should_skip(n, ids, _fake_vllm)]))
    list(loader.get_all_weights(None, None))
    loader = _loader(monkeypatch, plan, 0, flag=False)
    monkeypatch.setattr(DefaultModelLoader, "get_all_weights", lambda self, mc, m: iter(weights))
    list(loader.get_all_weights(None, None))


def test_unplaced_moe_layers_keep_vllms_linear_split():
    """DeepSeek-V3's MTP layer (61) is in the target's checkpoint but not in the placement: of its
    experts a rank reads what vLLM's own filter would, never all of them."""
    vllm_filter = pytest.importorskip("vllm.model_executor.model_loader.ep_weight_filter")
    e2r = [[2, 0, 1, 3, 0, 1, 0, 3, 1, 2], [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]]  # uneven: 3, 3, 2, 2
    plan = _plan(e2r, 4, moe_layers=(3, 4))
    for rank in range(4):
        ids = placed_experts(plan, rank, _pc(tp=2, dp=2))
        linear = vllm_filter.compute_local_expert_ids(10, 4, rank)
        for e in range(10):
            for name in (f"model.layers.61.mlp.experts.{e}.down_proj.weight", f"mtp.experts.{e}.w1.weight",
                         f"model.layers.0.mlp.experts.{e}.up_proj.weight"):  # an MoE layer smoe does not place
                assert should_skip(name, ids, vllm_filter.should_skip_weight) == (e not in linear), (rank, name)
            assert not should_skip(f"model.layers.61.mlp.experts.{e}.down_proj.weight_scale", ids,
                                   vllm_filter.should_skip_weight)
            # the placed layers keep the placement's slots
            assert should_skip(f"model.layers.3.mlp.experts.{e}.down_proj.weight", ids,
                               vllm_filter.should_skip_weight) == (e2r[0][e] != rank)
        assert set(ids) >= linear  # where only the union is asked, every id vLLM's split needs is read


def test_unplaced_moe_layers_with_copies_keep_vllms_initial_slot_names():
    """With copies vLLM builds every MoE layer with the redundant slots (EPLB's start: slot p >= E
    holds expert (p - E) % E), so an unplaced layer's rank reads the names its slots take."""
    from vllm_smoe.serving.place.load_plan import initial_physical_names

    e2r = [[0, 1, 0, 1, 0, 1, 0, 1]]
    plan = _plan(e2r, 2, [[[1, 0], [0, 1]]], moe_layers=(1,))
    names = initial_physical_names(8, plan.physical2expert.shape[1])
    for rank in range(2):
        ids = placed_experts(plan, rank, _pc())
        want = {int(names[p]) for p in plan.local_slots(rank)}
        read = {e for e in range(8) if not should_skip(f"model.layers.61.mlp.experts.{e}.w1.weight", ids, _fake_vllm)}
        assert read == want and len(want) < 8
    assert {int(names[p]) for p in plan.local_slots(1)} == {5, 6, 7, 0, 1}  # vLLM's linear split: 4..7


def test_one_rank_with_expert_parallelism_reads_every_expert():
    """--enable-expert-parallel on one GPU: vLLM's split is every expert (its filter is off); a
    placement for more ranks must not filter half of them away."""
    plan = _plan([[0, 1, 0, 1]], 2)
    assert placed_experts(plan, 0, _pc(tp=1, dp=1)) is None


def test_the_read_line_says_which_filter_was_in_force(monkeypatch):
    """vLLM's should_skip_weight not the one smoe was written for: smoe's per-layer test refused,
    vLLM tests the union over layers, and the line says so."""
    from vllm_smoe.serving.place.loader import _FUSED
    from vllm_smoe.serving.patches import model_loader

    plan = _plan([[0, 1, 0, 1]], 2)
    tally = ReadTally(plan, _FUSED)
    monkeypatch.setattr(model_loader, "install", lambda skip: False)
    refused = placed_experts(plan, 0, _pc())
    assert "fed this rank's placed slots" not in tally.line(0, refused)
    assert "union" in tally.line(0, refused) and "refused" in tally.line(0, refused)
    monkeypatch.setattr(model_loader, "install", lambda skip: True)
    assert tally.line(0, placed_experts(plan, 0, _pc())).endswith("fed this rank's placed slots")
    assert "pass --enable-ep-weight-filter" in tally.line(0, None)
