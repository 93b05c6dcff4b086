"""One device-side placement object (serving/location.py): a live swap moves the weights,
reorders the routers and updates the DeviceLocation in place, and every consumer (the token
order's state, the routers' EPLB route maps, the recorder) then reads the new placement."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_smoe.placement.predict import empty_tables  # noqa: E402
from vllm_smoe.serving.location import DeviceLocation  # noqa: E402
from vllm_smoe.serving.place.live import Swap, apply_swap  # noqa: E402
from vllm_smoe.serving.place.load_plan import LoadPlan, _physical_layout  # noqa: E402
from vllm_smoe.serving.place.loader import set_route  # noqa: E402
from vllm_smoe.serving.served import ServedPlacement, WorkerState  # noqa: E402

L, E, N, V = 2, 4, 2, 10
RANK = 1  # this worker's rank, tensor- and expert-parallel


def _plan(expert2rank, replicas) -> LoadPlan:
    expert2rank = np.asarray(expert2rank)
    slot2expert = np.argsort(expert2rank, axis=1, kind="stable").astype(np.int64)
    expert2slot = np.argsort(slot2expert, axis=1, kind="stable").astype(np.int64)
    p2e, route = _physical_layout(expert2rank, np.asarray(replicas), N, expert2slot)
    return LoadPlan((0, 1), slot2expert, expert2slot, p2e, route)


class _Router:
    """What smoe's set_route needs of vLLM's router: an EPLB layer state."""

    def __init__(self):
        self.eplb_state = SimpleNamespace()

    def _apply_eplb_mapping(self, ids):
        return self.eplb_state.logical_to_physical_map[ids, 0]


def _tables(seed):
    rng = np.random.default_rng(seed)
    return dataclasses.replace(empty_tables(L, V, E), token2rank=rng.integers(0, N, (L, V, 2)).astype(np.int16))


def test_a_swap_updates_the_one_device_location_every_consumer_reads():
    from vllm_smoe.serving.observe.counters import Observer
    from vllm_smoe.serving.observe.metrics import Drift
    from vllm_smoe.serving.record.recorder import Recorder
    from vllm_smoe.serving.speculate.predictors import TokenTables
    from vllm_smoe.serving.speculate.token_order import TokenOrder

    # one copy each per layer: rank 1 holds a replica of expert 0, rank 0 one of expert 3 (and back)
    old = _plan([[0, 0, 1, 1], [0, 1, 0, 1]], [[[0, 1], [3, 0]], [[0, 1], [1, 0]]])
    new = _plan([[1, 0, 1, 0], [1, 1, 0, 0]], [[[1, 0], [0, 1]], [[2, 1], [0, 0]]])
    assert old.num_redundant == new.num_redundant == 2 and (old.route2physical != new.route2physical).any()
    P = old.physical2expert.shape[1]
    routers = [_Router() for _ in range(L)]
    for layer, router in enumerate(routers):  # as smoe's loader routes them at load
        set_route(router, old.route2physical[layer, RANK], P, "cpu")
    maps = [r.eplb_state.logical_to_physical_map for r in routers]
    location = DeviceLocation(old, "cpu", N, RANK, routers, _tables(0))
    # the consumers, as the loader builds them around the location
    order = TokenOrder.__new__(TokenOrder)
    order.__dict__.update(rank=RANK, predictor=TokenTables(), counts=torch.zeros((L, 7), dtype=torch.long),
                          observer=Observer("order", RANK, 10.0, None, Drift(0.5, 0.8)))
    order._read_location(location)
    recorder = Recorder.__new__(Recorder)
    recorder.__dict__.update(location=location, writes=False)
    queued = recorder.slot_map()  # a step queued before the swap
    weights = [[torch.zeros(P, 1)] for _ in range(L)]  # moved as test_live checks; here only carried along
    state = WorkerState(torch.nn.Module(), SimpleNamespace(), SimpleNamespace(mode="speculate"),
                   ServedPlacement("a.yaml", SimpleNamespace(metrics={"lar": 0.5}), plan=old),
                   location=location, order=order, recorder=recorder)
    fresh = ServedPlacement("b.yaml", SimpleNamespace(metrics={"lar": 0.7}, predictor=object()), plan=new,
                            tables=_tables(1))
    held = (location.slot2expert, location.holds, location.tables["token2rank"])

    out = apply_swap(state, Swap(fresh, weights, None))

    assert out["placement"] == "b.yaml" and state.placement is fresh
    # the location: the new maps in the same tensors (captured graphs keep their addresses)
    assert all(a is b for a, b in zip((location.slot2expert, location.holds, location.tables["token2rank"]), held))
    assert torch.equal(location.slot2expert, torch.as_tensor(new.slot2expert))
    assert torch.equal(location.holds, torch.as_tensor(np.stack([new.held(r) for r in range(N)], axis=1)))
    assert torch.equal(location.tables["token2rank"], torch.as_tensor(_tables(1).token2rank))
    # the token order's state
    assert order.slot2expert is location.slot2expert and torch.equal(order.slot2expert, torch.as_tensor(new.slot2expert))
    assert torch.equal(order.held, torch.as_tensor(new.held(RANK)))
    assert torch.equal(order.tables["token2rank"], torch.as_tensor(_tables(1).token2rank))
    assert order.observer.drift.expected == 0.7
    # the routers' EPLB maps: the very tensors they held, with this rank's new routes
    for layer, router in enumerate(routers):
        assert router.eplb_state.logical_to_physical_map is maps[layer]
        assert router.eplb_state.logical_to_physical_map[:, 0].tolist() == new.route2physical[layer, RANK].tolist()
    # the recorder: the new map from now on, the queued step keeps the one it was served with
    assert torch.equal(recorder.slot_map(), torch.as_tensor(new.slot2expert))
    assert torch.equal(queued, torch.as_tensor(old.slot2expert))
