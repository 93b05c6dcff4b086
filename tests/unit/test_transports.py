"""Start-up advice that knows vLLM's all2all backends: a placement or DP routing over a transport
that moves every row says it saves no bytes there and names the backends that would. Stand-in
configs only (no engine start)."""

import types
import typing

import pytest

from vllm_smoe.serving.speculate.support import ORDERED_BACKENDS, speculate_transport
from vllm_smoe.serving.advice import advice
from vllm_smoe.serving.config import SmoeConfig
from vllm_smoe.serving.exchange.transports import (EVERY_ROW, FIXED_SLOTS, IN_KERNEL, PER_DESTINATION, TRANSPORTS, served_transport)

P = "p.yaml"
PER_DEST_GPU = [b for b, t in TRANSPORTS.items() if t.moves == PER_DESTINATION and b != "smoe_sparse"]


def _vc(backend="allgather_reducescatter", tp=1, dp=2, ep=True, nnodes=1, pcp=1):
    pc = types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
                               nnodes=nnodes, data_parallel_size_local=dp, all2all_backend=backend,
                               prefill_context_parallel_size=pcp)
    return types.SimpleNamespace(parallel_config=pc, scheduler_config=types.SimpleNamespace(max_num_seqs=256))


def _transport_lines(lines):
    return [ln for ln in lines if "all-to-all bytes" in ln]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("backend", ["allgather_reducescatter", "naive"])
def test_allgather_reducescatter_at_dp2_says_the_placement_saves_no_bytes(backend, tp):
    (line,) = advice(_vc(backend, tp=tp), SmoeConfig(placement=P), "cuda")
    assert "allgather_reducescatter" in line and "every MoE row reaches every expert-parallel rank" in line
    assert "placement and DP routing save no all-to-all bytes" in line
    assert "expert load" in line  # what the lossless reordering still gives
    assert "per-destination --all2all-backend: deepep_high_throughput (prefill-heavy)" in line
    assert "deepep_low_latency (decode)" in line
    assert f"smoe-place evaluate --trace REC --placement {P} --cluster" in line
    assert "--backend allgather-rs,deepep-ht,deepep-ll" in line and "docs/cluster-model.md" in line
    (off,) = advice(_vc(backend, tp=tp), SmoeConfig(placement=P, dp_routing=False), "cuda")
    assert "the placement saves no all-to-all bytes" in off and "DP routing" not in off


@pytest.mark.parametrize("backend", PER_DEST_GPU)
def test_per_destination_backends_pay_and_say_nothing(backend):
    assert advice(_vc(backend), SmoeConfig(placement=P), "cuda") == []
    assert advice(_vc(backend, tp=2), SmoeConfig(placement=P), "cuda") == []
    (off,) = advice(_vc(backend), SmoeConfig(placement=P, dp_routing=False), "cuda")
    assert "--smoe-dp-routing off" in off  # locality left to chance: that advice stays


def test_fixed_slot_and_in_kernel_backends_say_so():
    (moon,) = advice(_vc("moonep"), SmoeConfig(placement=P), "cuda")
    assert "moonep" in moon and "fixed" in moon and "save no all-to-all bytes" in moon
    (passthrough,) = advice(_vc("passthrough"), SmoeConfig(placement=P), "cuda")
    assert "passthrough" in passthrough and "unknown" in passthrough and "deepep_low_latency" in passthrough
    (new,) = advice(_vc("next_years_backend"), SmoeConfig(placement=P), "cuda")
    assert "'next_years_backend'" in new and "unknown" in new


def test_cpu_build_takes_smoes_exchange_unless_told_vllm():
    assert advice(_vc(), SmoeConfig(placement=P), "cpu") == []  # the sparse exchange, whatever vLLM's setting
    assert advice(_vc(), SmoeConfig(placement=P, all2all="sparse"), "cpu") == []
    (line,) = advice(_vc(), SmoeConfig(placement=P, all2all="vllm"), "cpu")
    assert "--smoe-all2all vllm" in line and "save no all-to-all bytes" in line
    assert "--backend allgather-rs,smoe-p2p" in line and "deepep" not in line


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_dp1_has_no_all2all_to_shrink(device):
    (line,) = advice(_vc(tp=2, dp=1), SmoeConfig(placement=P), device)
    assert "no all-to-all to shrink" in line and "not what crosses the link" in line and "expert load" in line
    if device == "cuda":
        assert "--all2all-backend: deepep_high_throughput" in line
    else:
        assert "over smoe's sparse exchange, or" in line  # already the CPU default: nothing to drop
    assert advice(_vc(tp=1, dp=1), SmoeConfig(placement=P), device) == []  # EP over one rank: nothing moves
    # prefill context parallelism turns vLLM's all2all on at DP = 1 (ParallelConfig.use_all2all)
    assert _transport_lines(advice(_vc(tp=2, dp=1, pcp=2), SmoeConfig(placement=P), "cuda"))


def test_nothing_to_judge_without_a_placement_or_expert_parallelism():
    assert advice(_vc(), SmoeConfig(), "cuda") == []
    assert advice(_vc(ep=False), SmoeConfig(placement=P), "cuda") == []
    assert advice(_vc(tp=2, dp=1, ep=False), SmoeConfig(placement=P), "cuda") == []


def test_speculate_over_allgather_reducescatter_is_refused_not_advised():
    """Speculate over a transport that moves every row does not start (speculate_transport); the
    advice adds no second line about the same thing."""
    vc = _vc(tp=4, dp=1, nnodes=2)
    spec = SmoeConfig(mode="speculate", placement=P)
    assert not _transport_lines(advice(vc, spec, "cuda"))
    assert not speculate_transport(vc.parallel_config, "cuda", None)[0]
    vc.parallel_config.all2all_backend = "deepep_low_latency"
    assert speculate_transport(vc.parallel_config, "cuda", None)[0] and advice(vc, spec, "cuda") == []


def test_served_transport():
    assert served_transport(_vc().parallel_config, "cuda", None, "place") == "allgather_reducescatter"
    assert served_transport(_vc("flashinfer_all2allv").parallel_config, "cuda", None, "place") == "flashinfer_all2allv"
    assert served_transport(_vc("deepep_low_latency").parallel_config, "cpu", None, "place") == "smoe_sparse"
    assert served_transport(_vc().parallel_config, "cpu", "vllm", "place") == "allgather_reducescatter"
    assert served_transport(_vc(tp=2, dp=1).parallel_config, "cuda", None, "place") is None
    assert served_transport(_vc(tp=2, dp=1).parallel_config, "cuda", None, "speculate") == "allgather_reducescatter"
    assert served_transport(_vc(ep=False).parallel_config, "cuda", None, "place") is None


def test_the_table_covers_vllms_backends_and_the_cost_models_names():
    from placement.a2a_cost import BACKENDS

    for t in TRANSPORTS.values():
        assert t.moves in (PER_DESTINATION, EVERY_ROW, FIXED_SLOTS, IN_KERNEL) and t.source
        assert t.model is None or t.model in BACKENDS
    assert set(ORDERED_BACKENDS) <= set(PER_DEST_GPU)  # speculate's transports all send per destination
    assert TRANSPORTS["allgather_reducescatter"].moves == EVERY_ROW
    parallel = pytest.importorskip("vllm.config.parallel")
    assert set(typing.get_args(parallel.All2AllBackend)) <= set(TRANSPORTS)
