"""Speculate's assignment + permutation kernel against its token-by-token twin and the served torch
ops, on irregular sizes (block edges and tails, ranks not a power of two, empty and full caps).
Runs under TRITON_INTERPRET=1 through tests/test_kernels.py; results must match exactly."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through tests/test_kernels.py (needs TRITON_INTERPRET=1 at import)", allow_module_level=True)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from vllm_smoe.kernels import assign as A  # noqa: E402
from vllm_smoe.serving.speculate import device_predict


def _case(L, T, P, N, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    pref = torch.randint(-1, N, (L, T, P), generator=g)
    conf = (torch.randint(0, 3, (L, T), generator=g).float() if ties else torch.rand((L, T), generator=g))
    return pref, conf


def _check(pref, conf, caps):
    order = torch.argsort(-conf, dim=1, stable=True)
    perm, inv = A.assign_permute(pref, order, caps, block=16)
    ref_perm, ref_inv = A.ref_assign_permute(pref, order, caps)
    assert torch.equal(perm, ref_perm) and torch.equal(inv, ref_inv)
    t_perm, t_inv = device_predict.permutation(device_predict.assign(pref, conf, caps))  # what serves on CPU
    assert torch.equal(perm, t_perm) and torch.equal(inv, t_inv)


@pytest.mark.parametrize("L,T,P,N", [(1, 1, 1, 2), (3, 17, 2, 3), (2, 33, 2, 8), (4, 50, 1, 5), (1, 64, 2, 2)])
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_equals_twin_and_served_ops_at_chunk_caps(L, T, P, N, ties):
    pref, conf = _case(L, T, P, N, L * 1000 + T * 7 + N, ties)
    _check(pref, conf, device_predict.chunk_caps(T, N))


def test_uneven_caps_and_an_empty_rank():
    pref, conf = _case(2, 40, 2, 4, 3)
    _check(pref, conf, torch.tensor([25, 0, 10, 5]))


def test_writes_into_longer_served_rows():
    pref, conf = _case(3, 21, 2, 3, 5)
    order = torch.argsort(-conf, dim=1, stable=True)
    perm = torch.full((3, 40), 7, dtype=torch.long)
    inv = torch.full((3, 40), 7, dtype=torch.long)
    p, i = A.assign_permute(pref, order, device_predict.chunk_caps(21, 3), perm, inv, block=8)
    assert torch.equal(p, A.ref_assign_permute(pref, order, device_predict.chunk_caps(21, 3))[0])
    assert (perm[:, 21:] == 7).all() and torch.equal(perm[:, :21], p) and torch.equal(inv[:, :21], i)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 3), T=st.integers(1, 70), P=st.integers(1, 2), N=st.integers(2, 9),
       seed=st.integers(0, 2**16))
def test_property_kernel_equals_twin(L, T, P, N, seed):
    pref, conf = _case(L, T, P, N, seed, ties=seed % 2 == 0)
    _check(pref, conf, device_predict.chunk_caps(T, N))
